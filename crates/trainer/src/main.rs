//! The `headroom` command.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};
use headroom_attn::AttentionConfig;
use headroom_mmap_data::{
    BuildSpec, InspectOptions, LlmcFlavor, SynthSpec, TokenFileFormat, TokenType,
};
use headroom_offload::StatePrecision;
use headroom_profiler::{search_max_fit, OutOfBudget};
use headroom_tensor::MemoryCategory;
use headroom_trainer::engine::ComputeDevice;
use headroom_trainer::estimate::estimate;
use headroom_trainer::ladder::{ladder_table, run_ladder, standard_rungs};
use headroom_trainer::model::{GptConfig, Precision};
use headroom_trainer::techniques::{CheckpointChoice, OptimizerChoice, OptimizerPlacement};
use headroom_trainer::train::{train, DataSource, StepLog, TrainOptions};

type CliResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

#[derive(Parser)]
#[command(
    name = "headroom",
    version,
    about = "Train GPTs that do not fit in memory, and see what each technique saves"
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Train the reference GPT (default: `tiny` on the synthetic source, CPU).
    Train(TrainArgs),
    /// Train the same model under a memory budget with techniques added one at a time.
    Ladder(LadderArgs),
    /// Predict peak memory per category for a config and technique set, without running.
    Estimate(RunArgs),
    /// The largest batch that fits a budget for a technique set.
    MaxBatch(MaxBatchArgs),
    /// Make, tokenise or describe token files.
    #[command(subcommand)]
    Data(DataCommand),
}

#[derive(Clone, Copy, ValueEnum)]
enum AttentionKind {
    Naive,
    Chunked,
    Flash,
}

#[derive(Clone, Copy, ValueEnum)]
enum PrecisionArg {
    Fp32,
    Bf16,
    Fp16,
}

#[derive(Clone, Copy, ValueEnum)]
enum ModelPreset {
    Tiny,
    Small,
    Gpt2,
}

#[derive(Clone, Copy, ValueEnum)]
enum OffloadArg {
    /// Optimizer state on the device.
    None,
    /// Optimizer state (and fp32 masters in bf16/fp16) in host RAM.
    Ram,
    /// Optimizer state in a memory-mapped file (see --offload-file).
    File,
}

#[derive(Clone, Copy, ValueEnum)]
enum DeviceArg {
    Cpu,
    Cuda,
}

/// Model, data and technique options shared by train, estimate and max-batch.
#[derive(Args, Clone)]
struct RunArgs {
    /// Model size: tiny (tests, seconds), small (6L/6H/384, context 256), gpt2 (124M).
    #[arg(long, value_enum, default_value = "tiny")]
    model: ModelPreset,
    /// Override the layer count of the preset.
    #[arg(long)]
    layers: Option<usize>,
    /// Override the heads of the preset.
    #[arg(long)]
    heads: Option<usize>,
    /// Override the width of the preset.
    #[arg(long)]
    channels: Option<usize>,
    /// Sequences per step.
    #[arg(long)]
    batch: Option<usize>,
    /// Tokens per sequence (default: the model's context, 64 for tiny).
    #[arg(long)]
    seq: Option<usize>,
    /// Numeric precision of working weights and activations (fp32 masters either way).
    #[arg(long, value_enum, default_value = "fp32")]
    precision: PrecisionArg,
    /// Attention algorithm.
    #[arg(long, value_enum, default_value = "flash")]
    attention: AttentionKind,
    /// Checkpoint schedule: none, every-K (e.g. every-2), sqrt-n, selective, optimal.
    #[arg(long, default_value = "none")]
    checkpoint: String,
    /// Compute the loss this many token rows at a time (fused head; no `[B,T,V]` logits).
    #[arg(long)]
    loss_chunk: Option<usize>,
    /// Where the optimizer state lives.
    #[arg(long, value_enum, default_value = "none")]
    offload: OffloadArg,
    /// File for --offload file.
    #[arg(long, default_value = "optimizer-state.bin")]
    offload_file: PathBuf,
    /// Blockwise 8-bit optimizer moments (about 2 bytes/param instead of 8).
    #[arg(long)]
    adam_8bit: bool,
    /// Sequences per micro-batch (gradients accumulated exactly, token-weighted).
    #[arg(long)]
    micro_batch: Option<usize>,
    /// Device memory budget in MiB: allocations beyond it fail with the tracker's report.
    #[arg(long)]
    budget_mib: Option<u64>,
    /// Train on this token file (any format headroom data inspect recognises) instead of
    /// the synthetic source.
    #[arg(long)]
    data: Option<PathBuf>,
    /// Where to run. cuda (built with the `cuda` feature): bf16 with flash attention only;
    /// masters and AdamW on the GPU unless an offload placement moves them to the host; without
    /// a GPU it fails with the typed "no CUDA device" error.
    #[arg(long, value_enum, default_value = "cpu")]
    device: DeviceArg,
}

#[derive(Parser)]
struct TrainArgs {
    #[command(flatten)]
    run: RunArgs,
    /// Optimizer steps.
    #[arg(long)]
    steps: Option<usize>,
    /// Peak learning rate.
    #[arg(long)]
    lr: Option<f64>,
    /// Seed for initialisation and data order.
    #[arg(long)]
    seed: Option<u64>,
    /// Write a checkpoint (safetensors + training state) into this directory.
    #[arg(long)]
    checkpoint_dir: Option<PathBuf>,
    /// Steps between checkpoints.
    #[arg(long, default_value_t = 100)]
    checkpoint_every: usize,
    /// Continue bit for bit from a checkpoint directory.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Stop after this many steps (the schedule stays that of --steps).
    #[arg(long)]
    stop_after: Option<usize>,
    /// Append one JSON line of metrics per step to this file.
    #[arg(long)]
    metrics: Option<PathBuf>,
    /// No progress bar (print a line every few steps instead).
    #[arg(long)]
    no_progress: bool,
}

#[derive(Parser)]
struct LadderArgs {
    /// Model size.
    #[arg(long, value_enum, default_value = "small")]
    model: ModelPreset,
    /// Device budget in MiB (the wall).
    #[arg(long, default_value_t = 512)]
    budget_mib: u64,
    /// Sequences per step.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Tokens per sequence (default: the model's context).
    #[arg(long)]
    seq: Option<usize>,
    /// Steps per rung.
    #[arg(long, default_value_t = 3)]
    steps: usize,
    /// Where to run.
    #[arg(long, value_enum, default_value = "cpu")]
    device: DeviceArg,
}

#[derive(Parser)]
struct MaxBatchArgs {
    #[command(flatten)]
    run: RunArgs,
    /// Largest batch to consider.
    #[arg(long, default_value_t = 4096)]
    limit: usize,
    /// Confirm the answer (and its neighbour) with real one-step runs under the budget.
    #[arg(long)]
    measure: bool,
}

#[derive(Subcommand)]
enum DataCommand {
    /// Write a token file from a random Markov chain (the trainer's synthetic source).
    Synth {
        /// Output file.
        out: PathBuf,
        /// Vocabulary.
        #[arg(long, default_value_t = 64)]
        vocab: u32,
        /// Successors per token.
        #[arg(long, default_value_t = 4)]
        branching: u32,
        /// Tokens to write.
        #[arg(long, default_value_t = 1 << 20)]
        tokens: u64,
        /// Seed (the trainer's default data uses 1337).
        #[arg(long, default_value_t = 1337)]
        seed: u64,
        /// File format: raw-u16, raw-u32, llmc, megatron.
        #[arg(long, default_value = "llmc")]
        format: String,
    },
    /// Tokenise a text file (byte-level) into a token file.
    Build {
        /// Input text.
        input: PathBuf,
        /// Output file.
        out: PathBuf,
        /// File format: raw-u16, raw-u32, llmc, megatron.
        #[arg(long, default_value = "llmc")]
        format: String,
        /// Document separator in the text (becomes one end-of-text token).
        #[arg(long)]
        separator: Option<String>,
    },
    /// Describe a token file: format, dtype, tokens, id range.
    Inspect {
        /// The file.
        path: PathBuf,
        /// Token type of a headerless raw file (guessed when absent).
        #[arg(long)]
        dtype: Option<String>,
    },
}

fn model_config(run: &RunArgs, vocab: usize) -> GptConfig {
    let mut cfg = match run.model {
        ModelPreset::Tiny => GptConfig::tiny(vocab),
        ModelPreset::Small => GptConfig::small(vocab),
        ModelPreset::Gpt2 => GptConfig {
            vocab,
            ..GptConfig::gpt2()
        },
    };
    if let Some(l) = run.layers {
        cfg.layers = l;
    }
    if let Some(h) = run.heads {
        cfg.heads = h;
    }
    if let Some(c) = run.channels {
        cfg.channels = c;
    }
    cfg
}

fn parse_checkpoint(s: &str) -> CliResult<CheckpointChoice> {
    Ok(match s {
        "none" => CheckpointChoice::None,
        "sqrt-n" | "sqrt" => CheckpointChoice::SqrtN,
        "selective" => CheckpointChoice::Selective,
        "optimal" => CheckpointChoice::Optimal(None),
        other => match other.strip_prefix("every-").map(str::parse::<usize>) {
            Some(Ok(k)) if k > 0 => CheckpointChoice::EveryK(k),
            _ => {
                return Err(format!(
                "unknown --checkpoint {other:?}: use none, every-K, sqrt-n, selective or optimal"
            )
                .into())
            }
        },
    })
}

/// The compute device: the CPU, or CUDA device 0 after probing it (a machine without a GPU
/// gets the typed "no CUDA device" error here, whatever the build).
fn compute_device(d: DeviceArg) -> CliResult<ComputeDevice> {
    match d {
        DeviceArg::Cpu => Ok(ComputeDevice::Cpu),
        DeviceArg::Cuda => {
            headroom_cuda::Cuda::new(0)?;
            Ok(ComputeDevice::Cuda { ordinal: 0 })
        }
    }
}

/// Options for a run from the shared arguments.
fn options(run: &RunArgs) -> CliResult<TrainOptions> {
    let device = compute_device(run.device)?;
    let mut o = match run.model {
        ModelPreset::Tiny => TrainOptions::tiny_default(),
        _ => TrainOptions::small_default(),
    };
    o.device = device;
    // A token file may hold any GPT-2-tokenised text: its model gets GPT-2's vocabulary.
    let vocab = match (&run.data, &o.data) {
        (None, DataSource::Synthetic(d)) => d.vocab as usize,
        _ => 50257,
    };
    if let Some(path) = &run.data {
        o.data = DataSource::File(path.clone());
    }
    o.model = model_config(run, vocab);
    o.seq = run.seq.unwrap_or(match run.model {
        ModelPreset::Tiny => o.seq,
        _ => o.model.max_seq,
    });
    if let Some(b) = run.batch {
        o.batch = b;
    }
    let t = &mut o.techniques;
    t.model.precision = match run.precision {
        PrecisionArg::Fp32 => Precision::Fp32,
        PrecisionArg::Bf16 => Precision::Bf16,
        PrecisionArg::Fp16 => Precision::Fp16,
    };
    t.model.attention = match run.attention {
        AttentionKind::Naive => AttentionConfig::naive(),
        AttentionKind::Chunked => AttentionConfig::chunked(),
        AttentionKind::Flash => AttentionConfig::flash(),
    };
    t.checkpoint = parse_checkpoint(&run.checkpoint)?;
    t.model.loss_chunk = run.loss_chunk;
    t.optimizer = OptimizerChoice {
        state: if run.adam_8bit {
            StatePrecision::Int8
        } else {
            StatePrecision::F32
        },
        placement: match run.offload {
            OffloadArg::None => OptimizerPlacement::Resident,
            OffloadArg::Ram => OptimizerPlacement::HostRam,
            OffloadArg::File => OptimizerPlacement::File(run.offload_file.clone()),
        },
    };
    t.micro_batch = run.micro_batch;
    o.budget = run.budget_mib.map(|m| m << 20);
    Ok(o)
}

fn mib(b: u64) -> f64 {
    b as f64 / (1u64 << 20) as f64
}

fn cmd_train(args: TrainArgs) -> CliResult {
    let mut o = options(&args.run)?;
    if let Some(s) = args.steps {
        o.steps = s;
    }
    if let Some(lr) = args.lr {
        o.lr = lr;
    }
    if let Some(s) = args.seed {
        o.seed = s;
    }
    o.save = args.checkpoint_dir.map(|d| (d, args.checkpoint_every));
    o.resume_from = args.resume;
    o.stop_after = args.stop_after;
    println!(
        "headroom train: GPT {}L/{}H/{}C, context {}, vocab {}; batch {}×{}, {} steps; {}",
        o.model.layers,
        o.model.heads,
        o.model.channels,
        o.model.max_seq,
        o.model.vocab,
        o.batch,
        o.seq,
        o.steps,
        o.techniques.describe()
    );
    let mut metrics = match &args.metrics {
        Some(p) => Some(std::io::BufWriter::new(std::fs::File::create(p).map_err(
            |e| format!("cannot create metrics file {}: {e}", p.display()),
        )?)),
        None => None,
    };
    let total = o.stop_after.map_or(o.steps, |s| s.min(o.steps)) as u64;
    let bar = if args.no_progress {
        None
    } else {
        let b = indicatif::ProgressBar::new(total);
        b.set_style(
            indicatif::ProgressStyle::with_template(
                "{bar:30} {pos}/{len} {msg} [{elapsed_precise}<{eta_precise}]",
            )
            .map_err(|e| e.to_string())?,
        );
        Some(b)
    };
    let every = (o.steps / 15).max(1);
    let mut metrics_err: Option<std::io::Error> = None;
    let report = train(&o, |s: &StepLog| {
        if let Some(w) = metrics.as_mut() {
            let line = serde_json::json!({
                "step": s.step, "loss": s.loss, "lr": s.lr, "grad_norm": s.grad_norm,
                "applied": s.applied, "loss_scale": s.loss_scale,
                "block_forwards": s.block_forwards, "seconds": s.seconds,
                "tokens_per_s": s.tokens_per_s, "live_bytes": s.live_bytes,
                "peak_bytes": s.peak_bytes,
            });
            if let Err(e) = writeln!(w, "{line}") {
                metrics_err.get_or_insert(e);
            }
        }
        let msg = format!(
            "loss {:.4}  {:>6.0} tok/s  live {:.1} MiB  peak {:.1} MiB",
            s.loss,
            s.tokens_per_s,
            mib(s.live_bytes),
            mib(s.peak_bytes)
        );
        match &bar {
            Some(b) => {
                b.set_position(s.step as u64 + 1);
                b.set_message(msg);
            }
            None => {
                if s.step % every == 0 || s.step + 1 == o.steps {
                    println!("step {:>5}  {msg}", s.step);
                }
            }
        }
    })?;
    if let Some(b) = bar {
        b.finish();
    }
    if let Some(e) = metrics_err {
        return Err(format!("writing metrics: {e}").into());
    }
    if let Some(mut w) = metrics {
        w.flush()?;
    }
    let last = report.final_loss(20);
    match report.entropy_floor {
        Some(floor) => println!(
            "final loss (mean of last 20 steps) {last:.4} nats/token; entropy floor of the source {floor:.4}; gap {:.1}%",
            100.0 * (last - floor) / floor
        ),
        None => println!("final loss (mean of last 20 steps) {last:.4} nats/token"),
    }
    println!("{}", report.memory_table);
    if let Some(h) = report.host_memory.device(headroom_tensor::Device::Cpu) {
        if h.peak_total > 0 {
            println!(
                "host (offloaded): {:.1} MiB peak (masters {:.1}, optimizer {:.1})",
                mib(h.peak_total),
                mib(h.peak[MemoryCategory::Parameters]),
                mib(h.peak[MemoryCategory::OptimizerState])
            );
        }
    }
    Ok(())
}

fn cmd_ladder(a: LadderArgs) -> CliResult {
    let device = compute_device(a.device)?;
    let mut base = match a.model {
        ModelPreset::Tiny => TrainOptions::tiny_default(),
        ModelPreset::Small => TrainOptions::small_default(),
        ModelPreset::Gpt2 => {
            let mut o = TrainOptions::small_default();
            o.model = GptConfig::gpt2();
            o
        }
    };
    base.device = device;
    base.batch = a.batch;
    base.seq = a.seq.unwrap_or(base.model.max_seq);
    base.steps = a.steps.max(2);
    let budget = a.budget_mib << 20;
    let rungs = standard_rungs(base.batch);
    println!(
        "headroom ladder: GPT {}L/{}H/{}C vocab {}, batch {}×{}, {} steps per rung, budget {} MiB",
        base.model.layers,
        base.model.heads,
        base.model.channels,
        base.model.vocab,
        base.batch,
        base.seq,
        base.steps,
        a.budget_mib
    );
    let results = run_ladder(&base, &rungs, budget, |r| {
        println!(
            "  {:<22} peak {:>8.1} MiB (estimate {:>8.1})  step {:.2} s  {}",
            r.name,
            mib(r.peak_total),
            mib(r.estimated_total),
            r.step_seconds,
            if r.fits { "fits" } else { "does not fit" }
        );
    })?;
    println!();
    println!("{}", ladder_table(&results, budget));
    Ok(())
}

fn cmd_estimate(run: RunArgs) -> CliResult {
    let o = options(&run)?;
    let e = estimate(&o.model, o.seq, o.micro_batch()?, o.batch, &o.techniques)?;
    println!(
        "estimate for GPT {}L/{}H/{}C vocab {} ({} parameters), batch {}×{}: {}",
        o.model.layers,
        o.model.heads,
        o.model.channels,
        o.model.vocab,
        e.parameter_count,
        o.batch,
        o.seq,
        o.techniques.describe()
    );
    println!("| category | device MiB | host MiB |\n|---|---|---|");
    for c in MemoryCategory::ALL {
        if e.device[c] > 0 || e.host[c] > 0 {
            println!(
                "| {c:?} | {:.1} | {:.1} |",
                mib(e.device[c]),
                mib(e.host[c])
            );
        }
    }
    println!(
        "| total | {:.1} | {:.1} |",
        mib(e.device_total()),
        mib(e.host.total())
    );
    if let Some(b) = o.budget {
        println!(
            "budget {:.1} MiB: {}",
            mib(b),
            if e.device_total() <= b {
                "fits"
            } else {
                "does not fit"
            }
        );
    }
    Ok(())
}

fn cmd_max_batch(a: MaxBatchArgs) -> CliResult {
    let o = options(&a.run)?;
    let budget = o
        .budget
        .ok_or("max-batch needs --budget-mib (the memory to fit)")?;
    let micro_fixed = o.techniques.micro_batch;
    let report = search_max_fit(o.batch.max(1), a.limit, |b| -> CliResult<bool> {
        let micro = micro_fixed.map_or(b, |m| m.min(b));
        if b % micro != 0 {
            return Ok(false);
        }
        let e = estimate(&o.model, o.seq, micro, b, &o.techniques)?;
        Ok(e.device_total() <= budget)
    })?;
    let Some(best) = report.largest_fit else {
        println!(
            "no batch fits {:.1} MiB with {}",
            mib(budget),
            o.techniques.describe()
        );
        return Ok(());
    };
    println!(
        "largest batch (estimated) that fits {:.1} MiB: {best} × {} tokens, with {} ({} trials)",
        mib(budget),
        o.seq,
        o.techniques.describe(),
        report.attempts.len()
    );
    if a.measure {
        for b in [best, best + 1] {
            let mut m = o.clone();
            m.batch = b;
            m.steps = 1;
            if let Some(mb) = micro_fixed {
                m.techniques.micro_batch = Some(mb.min(b));
            }
            let verdict = match train(&m, |_| {}) {
                Ok(r) => format!(
                    "fits (measured peak {:.1} MiB)",
                    mib(r
                        .memory
                        .device(headroom_tensor::Device::Cpu)
                        .map_or(0, |d| d.peak_total))
                ),
                Err(e) if OutOfBudget::find(&e).is_some() => {
                    "does not fit (tracker refused)".into()
                }
                Err(e) => return Err(e.into()),
            };
            println!("  measured batch {b}: {verdict}");
        }
    }
    Ok(())
}

fn parse_format(s: &str) -> CliResult<TokenFileFormat> {
    Ok(match s {
        "raw-u16" | "nanogpt" => TokenFileFormat::Raw(TokenType::U16),
        "raw-u32" => TokenFileFormat::Raw(TokenType::U32),
        "llmc" => TokenFileFormat::Llmc(LlmcFlavor::Gpt2),
        "megatron" => TokenFileFormat::Megatron {
            token_type: TokenType::U16,
            document_len: 1024,
        },
        other => {
            return Err(
                format!("unknown format {other:?}: use raw-u16, raw-u32, llmc or megatron").into(),
            )
        }
    })
}

fn cmd_data(c: DataCommand) -> CliResult {
    match c {
        DataCommand::Synth {
            out,
            vocab,
            branching,
            tokens,
            seed,
            format,
        } => {
            let spec = SynthSpec {
                vocab,
                branching,
                tokens,
                chain_seed: seed,
                stream_seed: seed ^ 0x5eed,
                format: parse_format(&format)?,
            };
            let s = headroom_mmap_data::synthesize(&spec, &out)?;
            println!("{s}");
        }
        DataCommand::Build {
            input,
            out,
            format,
            separator,
        } => {
            let mut spec = BuildSpec::new(parse_format(&format)?);
            spec.document_separator = separator.map(String::into_bytes);
            let s = headroom_mmap_data::build_from_text(&input, &spec, &out)?;
            println!("{s}");
        }
        DataCommand::Inspect { path, dtype } => {
            let mut opts = InspectOptions::default();
            if let Some(d) = dtype {
                opts.raw_token_type = Some(d.parse::<TokenType>()?);
            }
            let d = headroom_mmap_data::inspect(&path, &opts)?;
            println!("{d}");
        }
    }
    Ok(())
}

fn run(cli: Cli) -> CliResult {
    match cli.command {
        Some(Command::Train(a)) => cmd_train(a),
        None => cmd_train(TrainArgs::parse_from(["train"])),
        Some(Command::Ladder(a)) => cmd_ladder(a),
        Some(Command::Estimate(a)) => cmd_estimate(a),
        Some(Command::MaxBatch(a)) => cmd_max_batch(a),
        Some(Command::Data(c)) => cmd_data(c),
    }
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            let mut source = e.source();
            while let Some(s) = source {
                eprintln!("  caused by: {s}");
                source = s.source();
            }
            ExitCode::FAILURE
        }
    }
}
