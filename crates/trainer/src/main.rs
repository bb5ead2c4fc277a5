//! The `headroom` command.

use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use headroom_attn::AttentionConfig;
use headroom_trainer::train::{train, TrainOptions};

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
}

#[derive(Clone, Copy, ValueEnum)]
enum AttentionKind {
    Naive,
    Chunked,
    Flash,
}

#[derive(Parser)]
struct TrainArgs {
    /// Optimizer steps.
    #[arg(long)]
    steps: Option<usize>,
    /// Sequences per step.
    #[arg(long)]
    batch: Option<usize>,
    /// Peak learning rate.
    #[arg(long)]
    lr: Option<f64>,
    /// Seed for initialisation and data order.
    #[arg(long)]
    seed: Option<u64>,
    /// Attention algorithm.
    #[arg(long, value_enum)]
    attention: Option<AttentionKind>,
    /// Memory budget in MiB: allocations beyond it fail with the tracker's report.
    #[arg(long)]
    budget_mib: Option<u64>,
    /// Write a checkpoint (safetensors + training state) into this directory.
    #[arg(long)]
    checkpoint_dir: Option<std::path::PathBuf>,
    /// Steps between checkpoints.
    #[arg(long, default_value_t = 100)]
    checkpoint_every: usize,
    /// Continue bit for bit from a checkpoint directory.
    #[arg(long)]
    resume: Option<std::path::PathBuf>,
    /// Stop after this many steps (the schedule stays that of --steps).
    #[arg(long)]
    stop_after: Option<usize>,
}

fn run(cli: Cli) -> Result<(), Box<dyn std::error::Error>> {
    let args = match cli.command {
        Some(Command::Train(a)) => a,
        None => TrainArgs::parse_from(["train"]),
    };
    let mut o = TrainOptions::tiny_default();
    if let Some(s) = args.steps {
        o.steps = s;
    }
    if let Some(b) = args.batch {
        o.batch = b;
    }
    if let Some(lr) = args.lr {
        o.lr = lr;
    }
    if let Some(s) = args.seed {
        o.seed = s;
    }
    if let Some(a) = args.attention {
        o.attention = match a {
            AttentionKind::Naive => AttentionConfig::naive(),
            AttentionKind::Chunked => AttentionConfig::chunked(),
            AttentionKind::Flash => AttentionConfig::flash(),
        };
    }
    o.budget = args.budget_mib.map(|m| m << 20);
    o.checkpoint = args.checkpoint_dir.map(|d| (d, args.checkpoint_every));
    o.resume_from = args.resume;
    o.stop_after = args.stop_after;
    println!(
        "headroom train: GPT {}L/{}H/{}C, context {}, vocab {} on the synthetic Markov source; batch {}×{}, {} steps, {} attention",
        o.model.layers, o.model.heads, o.model.channels, o.seq, o.model.vocab, o.batch, o.seq, o.steps, o.attention.algorithm.name()
    );
    let every = (o.steps / 15).max(1);
    let report = train(&o, |s| {
        if s.step % every == 0 || s.step + 1 == o.steps {
            println!(
                "step {:>5}  loss {:.4}  lr {:.2e}  |g| {:.3}  {:>7.0} tok/s  live {:.2} MiB",
                s.step,
                s.loss,
                s.lr,
                s.grad_norm,
                s.tokens_per_s,
                s.live_bytes as f64 / (1 << 20) as f64
            );
        }
    })?;
    let last = report.final_loss(20);
    println!(
        "final loss (mean of last 20 steps) {last:.4} nats/token; entropy floor of the source {:.4}; gap {:.1}%",
        report.entropy_floor,
        100.0 * (last - report.entropy_floor) / report.entropy_floor
    );
    println!("{}", report.memory_table);
    Ok(())
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
