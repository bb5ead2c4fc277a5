//! The `headroom` command end to end: its subcommands run, print what they promise, and bad
//! input exits non-zero with the error chain.

use crate::common;

use std::process::{Command, Output};

use headroom_tensor::isa::IsaLevel;

fn headroom(args: &[&str]) -> Output {
    common::headroom_command().args(args).output().unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn data_synth_then_inspect_then_train_on_the_file_with_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("markov.bin");
    let d = data.to_str().unwrap();
    let o = headroom(&["data", "synth", d, "--vocab", "64", "--tokens", "50000"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = headroom(&["data", "inspect", d]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("50000"), "{}", stdout(&o));
    let metrics = dir.path().join("m.jsonl");
    let o = headroom(&[
        "train",
        "--data",
        d,
        "--channels",
        "32",
        "--steps",
        "3",
        "--batch",
        "2",
        "--no-progress",
        "--metrics",
        metrics.to_str().unwrap(),
        "--beta2",
        "0.99",
        "--lr-schedule",
        "linear",
        "--warmup",
        "1",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains(
            "\noptimizer: AdamW β (0.9, 0.99), ε 1e-8, weight decay 0.1; lr 3e-3, 1 warmup \
             steps, linear to 3e-4; grad clip 1\n"
        ),
        "{out}"
    );
    let lines = std::fs::read_to_string(&metrics).unwrap();
    let rows: Vec<serde_json::Value> = lines
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 3);
    assert!(rows.iter().all(|r| r["loss"].as_f64().unwrap() > 0.0));
    // Linear from the peak after one warmup step: 3e-3, then halfway to the floor 3e-4.
    let lr: Vec<f64> = rows.iter().map(|r| r["lr"].as_f64().unwrap()).collect();
    assert!(
        (lr[1] - 3e-3).abs() < 1e-12 && (lr[2] - 1.65e-3).abs() < 1e-12,
        "{lr:?}"
    );
    assert_eq!(rows[2]["step"], 2);
}

#[test]
fn text_build_round_trips_through_inspect() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("in.txt");
    std::fs::write(&text, "hello headroom\n\nsecond document\n").unwrap();
    let out = dir.path().join("text.bin");
    let o = headroom(&[
        "data",
        "build",
        text.to_str().unwrap(),
        out.to_str().unwrap(),
        "--separator",
        "\n\n",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = headroom(&["data", "inspect", out.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn estimate_prints_every_category_and_the_verdict() {
    let o = headroom(&[
        "estimate",
        "--model",
        "small",
        "--precision",
        "bf16",
        "--checkpoint",
        "sqrt-n",
        "--offload",
        "ram",
        // Below the peak on every machine: 419–422 MiB where the head keeps bf16 logits (AMX,
        // or gemm's depth blocks known on the widening path), 607 MiB where it keeps f32.
        "--budget-mib",
        "384",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = stdout(&o);
    for needle in [
        "Parameters",
        "Gradients",
        "Activations",
        "Workspace",
        "does not fit",
    ] {
        assert!(s.contains(needle), "{needle} missing from:\n{s}");
    }
}

/// `estimate --zero` reads `--batch` as `train --zero` does (the global batch), and each
/// rank's share is what the library estimate of that share says; bad splits are refused alike.
#[test]
fn zero_estimate_reads_the_global_batch_like_train() {
    use headroom_trainer::train::TrainOptions;
    use headroom_trainer::zero_train::{estimate_run, ZeroOptions};
    use headroom_zero::Stage;
    let args = [
        "estimate",
        "--model",
        "small",
        "--precision",
        "bf16",
        "--checkpoint",
        "sqrt-n",
        "--batch",
        "8",
        "--zero",
        "3",
        "--ranks",
        "4",
        "--budget-mib",
        "600",
    ];
    let o = headroom(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let s = stdout(&o);
    for needle in [
        "ZeRO-3 over 4 ranks",
        "batch 2×",
        "(global batch 8)",
        "| workspace |",
        "largest model of this width that fits",
    ] {
        assert!(s.contains(needle), "{needle} missing from:\n{s}");
    }
    // The printed peak is the library's estimate of one rank's share of the global batch.
    let mut opts = TrainOptions {
        batch: 8,
        ..TrainOptions::small_default()
    };
    opts.techniques.model.precision = headroom_trainer::model::Precision::Bf16;
    opts.techniques.checkpoint = headroom_trainer::techniques::CheckpointChoice::SqrtN;
    let (e, micro) = estimate_run(&opts, &ZeroOptions::new(Stage::Zero3, 4)).unwrap();
    assert_eq!(micro, 2);
    let peak = format!("{:.1} |", e.per_rank_peak() as f64 / (1u64 << 20) as f64);
    assert!(s.contains(&peak), "{peak} missing from:\n{s}");
    let o = headroom(&["estimate", "--batch", "6", "--zero", "1", "--ranks", "4"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--batch"), "{}", stderr(&o));
}

#[test]
fn max_batch_finds_a_batch_and_bad_input_is_an_error() {
    let o = headroom(&["max-batch", "--budget-mib", "64", "--limit", "64"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("largest batch"), "{}", stdout(&o));
    let o = headroom(&["max-batch"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("budget"), "{}", stderr(&o));
    let o = headroom(&["train", "--checkpoint", "every-0"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("every-K"), "{}", stderr(&o));
    let o = headroom(&["data", "inspect", "/nonexistent/file.bin"]);
    assert!(!o.status.success());
    assert!(stderr(&o).starts_with("error:"), "{}", stderr(&o));
}

#[test]
fn cuda_without_a_gpu_is_the_typed_no_device_error() {
    if headroom_cuda::Cuda::new(0).is_ok() {
        eprintln!("a CUDA device is present: this test is about machines without one");
        return;
    }
    let o = headroom(&["train", "--device", "cuda", "--steps", "1"]);
    assert!(!o.status.success());
    let e = stderr(&o).to_lowercase();
    assert!(e.contains("no cuda device"), "{e}");
}

/// `train --steps 4 --checkpoint-dir D` leaves a checkpoint of step 4 (saved at the end);
/// `--metrics` continues on `--resume` instead of truncating; lines are printed per step when
/// stdout is not a terminal; the final-loss line says over how many steps it averaged.
#[test]
fn train_saves_at_the_end_appends_metrics_on_resume_and_logs_without_a_terminal() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let metrics = dir.path().join("m.jsonl");
    let args = |extra: &[&str]| {
        let mut v = vec![
            "train",
            "--steps",
            "4",
            "--batch",
            "2",
            "--checkpoint-dir",
            ck.to_str().unwrap(),
            "--metrics",
            metrics.to_str().unwrap(),
        ];
        v.extend_from_slice(extra);
        v.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let run = |a: Vec<String>| {
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        headroom(&a)
    };
    let o = run(args(&["--stop-after", "2", "--checkpoint-every", "1"]));
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("step     0") && out.contains("step     1"),
        "{out}"
    );
    assert!(out.contains("mean of last 2 steps"), "{out}");
    let o = run(args(&[
        "--resume",
        ck.to_str().unwrap(),
        "--checkpoint-every",
        "0",
    ]));
    assert!(o.status.success(), "{}", stderr(&o));
    let steps: Vec<u64> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(steps, vec![0, 1, 2, 3]);
    assert!(ck.join("step-00000004").join("manifest.json").is_file());
    // A fresh run into the same directory is refused, the error says what to do.
    let o = run(args(&[]));
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--resume"), "{}", stderr(&o));
}

/// `headroom train | head -1`: the reader goes away, the command ends quietly.
#[test]
fn a_closed_stdout_ends_the_command_quietly() {
    use std::io::{BufRead, BufReader};
    let mut child = common::headroom_command()
        .args(["train", "--steps", "200", "--batch", "2"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut first)
        .unwrap();
    assert!(first.starts_with("headroom train"), "{first}");
    // The reader is dropped here: the next line hits a broken pipe.
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{:?}: {err}", out.status);
    assert!(!err.contains("panicked"), "{err}");
}

/// Sizes that used to abort, wrap or print nonsense are errors that name the option.
#[test]
fn absurd_sizes_are_errors_naming_the_option() {
    let cases: &[(&[&str], &str)] = &[
        (&["train", "--budget-mib", "0"], "--budget-mib"),
        (&["train", "--budget-mib", "17592186044416"], "--budget-mib"),
        (&["train", "--micro-batch", "0"], "--micro-batch"),
        (
            &["train", "--batch", "1000000000", "--steps", "1"],
            "--batch",
        ),
        (&["train", "--layers", "10000000", "--steps", "1"], "layers"),
        (
            &[
                "estimate",
                "--channels",
                "4611686018427387904",
                "--heads",
                "1",
            ],
            "channels",
        ),
        (&["train", "--keep-checkpoints", "0"], "--keep-checkpoints"),
        (&["train", "--grad-clip=-1", "--steps", "1"], "--grad-clip"),
        (
            &["train", "--beta1", "1", "--steps", "1"],
            "--beta1: 1 is not in [0, 1)",
        ),
        (&["train", "--beta2=-0.5", "--steps", "1"], "--beta2"),
        (&["train", "--adam-eps=-1e-8", "--steps", "1"], "--adam-eps"),
        (
            &["train", "--lr-schedule", "constant", "--min-lr", "1e-4"],
            "--min-lr: the constant schedule does not decay",
        ),
        (&["train", "--lr-schedule", "step"], "--lr-schedule"),
        (&["train", "--lora-rank", "0"], "--lora-rank"),
        (
            &["train", "--lora-rank", "4", "--lora-dropout", "1"],
            "--lora-dropout",
        ),
        (
            &["train", "--lora-rank", "4", "--lora-alpha=-2"],
            "--lora-alpha",
        ),
        (
            &["train", "--lora-rank", "4", "--lora-targets", "nowhere"],
            "--lora-targets",
        ),
        (
            &[
                "train",
                "--lora-rank",
                "4",
                "--quantize",
                "nf4",
                "--quant-blocksize",
                "48",
            ],
            "--quantize",
        ),
        (
            &["train", "--lora-rank", "99999999", "--steps", "1"],
            "--lora-rank",
        ),
        (&["train", "--merge-into", "x"], "--lora-rank"),
        (
            &["estimate", "--model", "small", "--seq", "2048"],
            "--seq: 2048 exceeds the model's context 256 (a preset's is set by --context)",
        ),
    ];
    for (args, needle) in cases {
        let o = headroom(args);
        let e = stderr(&o);
        assert!(!o.status.success(), "{args:?} succeeded: {}", stdout(&o));
        assert!(e.contains(needle), "{args:?}: {e}");
        assert!(
            !e.contains("panicked") && !e.contains("memory allocation"),
            "{e}"
        );
    }
}

#[test]
fn estimate_for_cuda_runs_without_a_gpu() {
    let o = headroom(&[
        "estimate",
        "--device",
        "cuda",
        "--model",
        "small",
        "--precision",
        "bf16",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
}

/// The per-preset defaults `--help` shows are the ones a run uses.
#[test]
fn help_shows_the_real_defaults() {
    use headroom_trainer::train::TrainOptions;
    let o = headroom(&["train", "--help"]);
    let help = stdout(&o).split_whitespace().collect::<Vec<_>>().join(" ");
    let (tiny, small) = (TrainOptions::tiny_default(), TrainOptions::small_default());
    for needle in [
        format!(
            "{} for tiny, {} for small and gpt2",
            tiny.steps, small.steps
        ),
        format!("{:e} for tiny, {:e} for small and gpt2", tiny.lr, small.lr),
        format!(
            "{} for tiny, {} for small and gpt2",
            tiny.warmup, small.warmup
        ),
        format!("{} × the peak learning rate", tiny.min_lr_frac),
        format!("[default: {}]", tiny.weight_decay),
        format!("[default: {:.1}]", tiny.grad_clip),
        format!("β1, the first moment's decay [default: {}]", tiny.beta1),
        format!("β2, the second moment's decay [default: {},", tiny.beta2),
        format!("[default: {:e}]", tiny.eps),
        format!("[default: {}]", tiny.lr_schedule.name()),
    ] {
        assert!(help.contains(&needle), "--help lacks {needle:?}:\n{help}");
    }
    assert_eq!(
        (tiny.weight_decay, tiny.grad_clip, tiny.min_lr_frac),
        (small.weight_decay, small.grad_clip, small.min_lr_frac)
    );
    assert_eq!(
        (tiny.beta1, tiny.beta2, tiny.eps, tiny.lr_schedule),
        (small.beta1, small.beta2, small.eps, small.lr_schedule)
    );
}

/// `max-batch --measure` confirms the boundary with measured steps (a fit at b, a refusal at
/// b + 1); with `--micro-batch` it searches the micro-batch (divisors of the batch); a limit
/// that fits says so instead of posing as the answer; nothing fitting is an error.
#[test]
fn max_batch_confirms_the_boundary_by_measuring() {
    let o = headroom(&[
        "max-batch",
        "--budget-mib",
        "4",
        "--limit",
        "256",
        "--measure",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let line = out
        .lines()
        .find(|l| l.starts_with("largest batch that fits"))
        .unwrap_or_else(|| panic!("no measured answer:\n{out}"));
    let b: usize = line
        .split("measured: ")
        .nth(1)
        .and_then(|s| s.split_whitespace().next())
        .and_then(|s| s.parse().ok())
        .unwrap();
    assert!(out.contains(&format!("measured batch {b}: fits")), "{out}");
    assert!(
        out.contains(&format!("measured batch {}: does not fit", b + 1)),
        "{out}"
    );
    let o = headroom(&[
        "max-batch",
        "--budget-mib",
        "4",
        "--batch",
        "64",
        "--micro-batch",
        "1",
        "--measure",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("largest micro-batch that fits"),
        "{}",
        stdout(&o)
    );
    let o = headroom(&["max-batch", "--budget-mib", "400", "--limit", "16"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("raise --limit"), "{}", stdout(&o));
    let o = headroom(&["max-batch", "--model", "small", "--budget-mib", "64"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("no batch fits"), "{}", stderr(&o));
}

/// Start `headroom train ARGS --checkpoint-dir CK`, wait until step 2 is logged, send SIGTERM
/// and return the finished process's output (stdout drained meanwhile).
fn sigterm_after_step_2(args: &[&str], ck: &std::path::Path) -> Output {
    use std::io::{BufRead, BufReader};
    let mut child = common::headroom_command()
        .args(args)
        .arg("--checkpoint-dir")
        .arg(ck)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    // Wait until training runs (the header, then step lines).
    for line in lines.by_ref() {
        if line.unwrap().starts_with("step     2") {
            break;
        }
    }
    let st = Command::new("sh")
        .arg("-c")
        .arg(format!("kill -TERM {}", child.id()))
        .status()
        .unwrap();
    assert!(st.success());
    // Keep reading so the child never blocks on a full pipe.
    let drain = std::thread::spawn(move || lines.count());
    let out = child.wait_with_output().unwrap();
    drain.join().unwrap();
    out
}

/// SIGTERM (as SIGINT) saves a checkpoint of the last finished step and exits with 128 + 15;
/// the checkpoint resumes.
#[test]
fn a_signal_saves_a_checkpoint_and_exits_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let out = sigterm_after_step_2(
        &[
            "train",
            "--steps",
            "100000",
            "--batch",
            "2",
            "--checkpoint-every",
            "0",
        ],
        &ck,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + 15), "{err}");
    assert!(err.contains("stopped by signal 15"), "{err}");
    let saved = headroom_trainer::checkpoint::load(&ck).unwrap();
    assert!(saved.state.step >= 3, "step {}", saved.state.step);
}

/// Under `--zero`, SIGTERM stops every rank after the same step, each saves its shard, and
/// the run resumes (here on another rank count).
#[test]
fn a_signal_under_zero_saves_every_ranks_shard() {
    let dir = tempfile::tempdir().unwrap();
    let ck = dir.path().join("ck");
    let out = sigterm_after_step_2(
        &[
            "train",
            "--zero",
            "3",
            "--ranks",
            "2",
            "--steps",
            "100000",
            "--batch",
            "4",
            "--checkpoint-every",
            "0",
        ],
        &ck,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(128 + 15), "{err}");
    assert!(err.contains("stopped by signal 15"), "{err}");
    let saved = headroom_trainer::zero_checkpoint::load(&ck).unwrap();
    assert!(saved.state.step >= 3, "step {}", saved.state.step);
    assert_eq!(saved.state.ranks, 2);
}

/// `--data` on a text file is refused with a pointer to `headroom data build`, never trained
/// on as if its bytes were token ids.
#[test]
fn text_given_as_data_is_refused_with_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("corpus.txt");
    std::fs::write(
        &text,
        "The quick brown fox — jumps over the lazy dog.\n".repeat(200),
    )
    .unwrap();
    let o = headroom(&["train", "--steps", "1", "--data", text.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("headroom data build"), "{}", stderr(&o));
}

/// `--data W1 A W2 B` blends the files as Megatron's --data-path does, and says what each
/// file's share of the run is; `--data A B` is one dataset of both; `--val-data` takes the
/// same; values that are neither paths nor weight-path pairs are refused by name.
#[test]
fn data_takes_megatrons_weighted_blend() {
    let dir = tempfile::tempdir().unwrap();
    let p = |n: &str| dir.path().join(n).to_str().unwrap().to_string();
    for (name, seed) in [("web.bin", "1"), ("code.bin", "2")] {
        let o = headroom(&[
            "data",
            "synth",
            &p(name),
            "--vocab",
            "64",
            "--tokens",
            "5000",
            "--seed",
            seed,
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
    }
    let train = |data: &[&str]| {
        let mut args = vec![
            "train", "--vocab", "64", "--steps", "2", "--batch", "4", "--seq",
        ];
        args.extend(["16", "--no-progress", "--data"]);
        args.extend(data);
        headroom(&args)
    };
    let (web, code) = (p("web.bin"), p("code.bin"));
    let o = train(&[
        "0.7",
        &web,
        "0.3",
        &code,
        "--val-data",
        "1",
        &code,
        "1",
        &web,
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("data: a blend of 2 files"), "{out}");
    assert!(out.contains("validation loss"), "{out}");
    assert!(
        out.contains(&format!(" 70.0%  {web}: 5000 tokens")),
        "{out}"
    );
    assert!(
        out.contains(&format!(" 30.0%  {code}: 5000 tokens")),
        "{out}"
    );
    // Two validation sets: each its own loss, in the step lines, the metrics and the summary.
    let metrics = dir.path().join("m.jsonl");
    let m = metrics.to_str().unwrap();
    let o = train(&[
        &web,
        "--val-data",
        &web,
        "--val-data",
        &code,
        "--metrics",
        m,
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains(&format!("  {web}: ")) && out.contains(&format!("  {code}: ")),
        "{out}"
    );
    let last = std::fs::read_to_string(&metrics).unwrap();
    let last: serde_json::Value = serde_json::from_str(last.lines().last().unwrap()).unwrap();
    let sets = last["val_losses"].as_object().unwrap();
    assert_eq!(sets.len(), 2, "{last}");
    assert!(sets[&web].is_number() && sets[&code].is_number(), "{last}");
    let step_line = out
        .lines()
        .find(|l| l.starts_with("step") && l.contains("val"))
        .unwrap();
    assert!(step_line.contains(" ["), "{step_line}");
    // Paths alone: one dataset of both, as a glob of shards would be.
    let o = train(&[&web, &code]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stdout(&o).contains("data: a blend"), "{}", stdout(&o));
    for bad in [
        vec!["0.7", web.as_str(), "0.3"],
        vec![web.as_str(), "1", code.as_str()],
        vec!["0", web.as_str(), "1", code.as_str()],
        vec!["-1", web.as_str(), "1", code.as_str()],
    ] {
        let o = train(&bad);
        assert!(!o.status.success(), "{bad:?}");
        assert!(
            stderr(&o).contains("weight-path pairs"),
            "{bad:?}: {}",
            stderr(&o)
        );
    }
    let o = train(&[&web, "--val-data", "1", &code, "2"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("--val-data: several files"),
        "{}",
        stderr(&o)
    );
    // A file named like a number is not taken for a weight in silence.
    std::fs::copy(&web, dir.path().join("2024")).unwrap();
    let o = common::headroom_command()
        .current_dir(dir.path())
        .args([
            "train", "--vocab", "64", "--steps", "1", "--batch", "4", "--seq", "16",
        ])
        .args(["--data", "2024", "code.bin"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("both a number and a file"),
        "{}",
        stderr(&o)
    );
    // A file that is missing is named.
    let o = train(&["1", &web, "1", &p("missing.bin")]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("missing.bin"), "{}", stderr(&o));
}

#[test]
fn val_data_reports_a_validation_loss_in_lines_metrics_and_summary() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("v.bin");
    let o = headroom(&["data", "synth", data.to_str().unwrap(), "--tokens", "20000"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let metrics = dir.path().join("m.jsonl");
    let o = headroom(&[
        "train",
        "--steps",
        "4",
        "--batch",
        "2",
        "--val-data",
        data.to_str().unwrap(),
        "--eval-every",
        "2",
        "--eval-batches",
        "2",
        "--metrics",
        metrics.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("val "), "{out}");
    assert!(out.contains("validation loss"), "{out}");
    let vals: Vec<bool> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["val_loss"].is_number())
        .collect();
    assert_eq!(vals, vec![false, true, false, true]);
}

#[test]
fn the_vocabulary_of_a_token_file_run_comes_from_vocab_not_a_fixed_50257() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("markov.bin");
    let d = data.to_str().unwrap();
    let o = headroom(&["data", "synth", d, "--vocab", "64", "--tokens", "20000"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let train = |vocab: &str| {
        headroom(&[
            "train",
            "--data",
            d,
            "--vocab",
            vocab,
            "--steps",
            "2",
            "--batch",
            "2",
            "--seq",
            "16",
            "--no-progress",
        ])
    };
    let o = train("64");
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("vocab 64"), "{}", stdout(&o));
    // Ids of the file at or above --vocab are refused, naming the file, the id and the
    // vocabulary.
    let o = train("32");
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(
        e.contains(&format!("{d} holds token id"))
            && e.contains("outside the model's vocabulary of 32 ids"),
        "{e}"
    );
    let fixture = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/hf-llama-gqa-untied"
    );
    let o = headroom(&[
        "train",
        "--init-from",
        fixture,
        "--vocab",
        "64",
        "--steps",
        "1",
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--vocab"), "{}", stderr(&o));
}

#[test]
fn zero_ranks_train_save_resume_elsewhere_and_consolidate() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let one = dir.path().join("one");
    let (run_s, one_s) = (run.to_str().unwrap(), one.to_str().unwrap());
    let common = [
        "train",
        "--steps",
        "4",
        "--batch",
        "4",
        "--grad-clip",
        "inf",
    ];
    let with = |extra: &[&str]| {
        let mut v = common.to_vec();
        v.extend_from_slice(extra);
        headroom(&v)
    };
    let o = with(&[
        "--zero",
        "3",
        "--ranks",
        "2",
        "--stop-after",
        "2",
        "--checkpoint-dir",
        run_s,
        "--checkpoint-every",
        "2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("over 2 ranks, ZeRO-3"), "{out}");
    for rank in ["   0  ", "   1  "] {
        assert!(out.lines().any(|l| l.starts_with(rank)), "{out}");
    }
    // Two ranks' checkpoint, resumed on four under another stage: steps 2 and 3 run.
    let o = with(&[
        "--zero",
        "1",
        "--ranks",
        "4",
        "--micro-batch",
        "1",
        "--resume",
        run_s,
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("step     2") && out.contains("step     3"),
        "{out}"
    );
    // One ordinary checkpoint, which the single-process trainer resumes.
    let o = headroom(&["checkpoint", "consolidate", run_s, one_s]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(one
        .join("step-00000002")
        .join("model.safetensors")
        .is_file());
    // `checkpoint verify` tells the two kinds apart and checks every rank's file.
    let o = headroom(&["checkpoint", "verify", run_s]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains(", ZeRO-"), "{}", stdout(&o));
    assert!(
        stdout(&o).contains("one file per rank of "),
        "{}",
        stdout(&o)
    );
    let o = headroom(&["checkpoint", "verify", one_s]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("step 2 of 4, the model and its f32 AdamW moments"),
        "{}",
        stdout(&o)
    );
    let o = with(&["--resume", one_s]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("step     3"));
    // The ordinary loaders refuse the sharded checkpoint with the way out.
    let o = with(&["--resume", run_s]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("consolidate"), "{}", stderr(&o));
    // Bad splits and unsupported combinations name what is wrong.
    let o = with(&["--zero", "2", "--ranks", "3"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--batch"), "{}", stderr(&o));
    let o = with(&["--zero", "4", "--ranks", "2"]);
    assert!(!o.status.success());
    // A run the machine cannot hold is refused before anything is allocated.
    let o = with(&[
        "--zero", "3", "--ranks", "2", "--model", "small", "--layers", "3000",
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("the machine has"), "{}", stderr(&o));
    // Memory reports: one file per rank.
    let trace = dir.path().join("trace.json");
    let o = with(&[
        "--zero",
        "1",
        "--ranks",
        "2",
        "--memory-trace",
        trace.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    for rank in 0..2 {
        let p = dir.path().join(format!("trace.rank{rank}.json"));
        assert!(p.is_file(), "{}", p.display());
    }
    assert!(!trace.exists());
    let o = with(&["--zero", "1", "--ranks", "2", "--lora-rank", "4"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--zero"), "{}", stderr(&o));
}

/// `headroom train --zero S --dist nccl` where it cannot run (no GPU, no NCCL, no `cuda`
/// feature, no launcher, a missing or misplaced id file): a clear error naming what is
/// missing, and no id file left behind for the next job to trip on.
#[test]
fn dist_nccl_without_what_it_needs_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let id_file = dir.path().join("nccl-id");
    let command = |extra: &[&str], env: &[(&str, &str)]| {
        let mut c = common::headroom_command();
        c.args(["train", "--zero", "3", "--steps", "1", "--batch", "2"])
            .args(extra);
        for var in [
            "OMPI_COMM_WORLD_RANK",
            "OMPI_COMM_WORLD_SIZE",
            "PMI_RANK",
            "PMI_SIZE",
            "SLURM_PROCID",
            "SLURM_NTASKS",
            "RANK",
            "WORLD_SIZE",
        ] {
            c.env_remove(var);
        }
        c.envs(env.iter().copied());
        c
    };
    let run = |extra: &[&str], env: &[(&str, &str)]| {
        let o = command(extra, env).output().unwrap();
        assert!(!o.status.success(), "{extra:?} succeeded");
        stderr(&o)
    };
    let file = id_file.to_str().unwrap();
    let e = run(&["--dist", "nccl"], &[]);
    assert!(e.contains("--nccl-id-file"), "{e}");
    let e = run(&["--dist", "nccl", "--nccl-id-file", file], &[]);
    assert!(e.contains("--device cuda"), "{e}");
    let e = run(&["--ranks", "2", "--nccl-id-file", file], &[]);
    assert!(e.contains("is for --dist nccl"), "{e}");
    // With --device cuda, the first thing missing is named: the `cuda` feature, a CUDA device
    // (checked before any rank connects), the launcher's rank, libnccl. (The launcher and the
    // id file's protocol are unit-tested in headroom-zero's `rendezvous`.)
    let gpu = [
        "--dist",
        "nccl",
        "--nccl-id-file",
        file,
        "--device",
        "cuda",
        "--precision",
        "bf16",
        // head_dim 64: the CUDA attention kernels' smallest.
        "--heads",
        "1",
    ];
    let named = |e: &str, specific: &str| {
        e.contains("cuda` feature") || e.contains("no CUDA device") || e.contains(specific)
    };
    let e = run(&gpu, &[]);
    assert!(named(&e, "no launcher's rank"), "{e}");
    let e = run(&gpu, &[("RANK", "3"), ("WORLD_SIZE", "2")]);
    assert!(named(&e, "not a rank of"), "{e}");
    // As rank 0 of a one-process torchrun job: where the build, a GPU and libnccl are all
    // there this is a real one-rank NCCL run; elsewhere the missing piece is named. Either way
    // no id file is left behind for the next job.
    let o = command(&gpu, &[("RANK", "0"), ("WORLD_SIZE", "1")])
        .output()
        .unwrap();
    if o.status.success() {
        let env = stdout(&headroom(&["env"]));
        let devices = env.lines().find_map(|l| {
            l.strip_prefix("cuda: ")?
                .split(' ')
                .next()?
                .parse::<u32>()
                .ok()
        });
        assert!(
            devices.is_some_and(|n| n > 0),
            "a one-rank NCCL run succeeded without a CUDA device: {env}"
        );
        assert!(stdout(&o).contains("ZeRO-3"), "{}", stdout(&o));
    } else {
        assert!(named(&stderr(&o), "NCCL"), "{}", stderr(&o));
    }
    assert!(!id_file.exists());
}

/// `headroom train --zero S --dist mpi` from a build without MPI: the whole command line goes
/// to the MPI build, whose exit status is the command's; with none to hand to, or one that is
/// itself without MPI, a clear error instead of a hang or a loop.
#[cfg(unix)]
#[test]
fn dist_mpi_hands_the_command_to_the_mpi_build() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let args = ["train", "--zero", "3", "--dist", "mpi", "--steps", "2"];
    let run = |mpi_build: &std::ffi::OsStr| {
        common::headroom_command()
            .args(args)
            .env("HEADROOM_MPI", mpi_build)
            .output()
            .unwrap()
    };
    // A stand-in for headroom-mpi: reports what it was given and exits with status 7.
    let fake = dir.path().join("headroom-mpi");
    let seen = dir.path().join("seen");
    std::fs::write(
        &fake,
        format!(
            "#!/bin/sh\necho \"$HEADROOM_MPI_HANDED_OVER $*\" > '{}'\nexit 7\n",
            seen.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let o = run(fake.as_os_str());
    assert_eq!(o.status.code(), Some(7), "{}", stderr(&o));
    assert_eq!(
        std::fs::read_to_string(&seen).unwrap().trim(),
        format!("1 {}", args.join(" "))
    );
    // Nothing to hand to: the error says how to get the MPI build.
    let o = run("".as_ref());
    assert!(!o.status.success());
    assert!(stderr(&o).contains("crates/trainer-mpi"), "{}", stderr(&o));
    // A HEADROOM_MPI naming a build without MPI fails once instead of handing over forever.
    let o = run(common::headroom_path().as_ref());
    assert!(!o.status.success());
    assert!(stderr(&o).contains("wrong binary"), "{}", stderr(&o));
    // In-process ranks never look for it.
    let o = common::headroom_command()
        .args([
            "train", "--zero", "1", "--ranks", "2", "--steps", "1", "--batch", "2",
        ])
        .env("HEADROOM_MPI", fake.as_os_str())
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
}

/// `HEADROOM_CPU_ISA` caps headroom's own kernels (not gemm's), and every one of them gives the
/// portable code's bits: a run capped at the baseline and one allowed AVX-512 agree on every
/// loss and gradient norm, in fp32, with 8-bit AdamW and in bf16 (whose stochastic rounding
/// and widening are SIMD kernels too). AMX's bf16 products round otherwise, so neither cap
/// allows them. A value that names nothing is refused before any work.
#[test]
fn the_cpu_isa_cap_changes_which_kernels_run_but_not_one_bit() {
    let dir = std::env::temp_dir().join(format!("headroom-isa-cap-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let run = |cap: &str, extra: &[&str], tag: &str| {
        let metrics = dir.join(format!("{tag}-{cap}.jsonl"));
        let mut args = vec!["train", "--steps", "12", "--no-progress", "--metrics"];
        args.push(metrics.to_str().unwrap());
        args.extend_from_slice(extra);
        let out = common::headroom_command()
            .args(&args)
            .env("HEADROOM_CPU_ISA", cap)
            .output()
            .unwrap();
        assert!(out.status.success(), "{cap} {tag}: {}", stderr(&out));
        let header = stdout(&out).lines().next().unwrap_or("").to_string();
        let steps: Vec<(String, String)> = std::fs::read_to_string(&metrics)
            .unwrap()
            .lines()
            .map(|line| {
                let v: serde_json::Value = serde_json::from_str(line).unwrap();
                (v["loss"].to_string(), v["grad_norm"].to_string())
            })
            .collect();
        (header, steps)
    };
    for (tag, extra) in [
        ("fp32", &[][..]),
        ("adam8", &["--adam-8bit"][..]),
        ("bf16", &["--precision", "bf16"][..]),
    ] {
        let (low_header, low) = run("baseline", extra, tag);
        let (high_header, high) = run("avx512", extra, tag);
        assert!(
            low_header.contains("cpu kernels baseline"),
            "{tag}: {low_header}"
        );
        let high_level = headroom_tensor::isa::detected().min(IsaLevel::Avx512);
        assert!(
            high_header.contains(&format!("cpu kernels {high_level}")),
            "{tag}: {high_header}"
        );
        assert_eq!(low.len(), 12, "{tag}");
        assert_eq!(low, high, "{tag}: the capped run's losses or norms differ");
    }
    let bad = common::headroom_command()
        .args(["train", "--steps", "1", "--no-progress"])
        .env("HEADROOM_CPU_ISA", "avx1024")
        .output()
        .unwrap();
    assert!(!bad.status.success());
    let text = stderr(&bad);
    assert!(
        text.contains("HEADROOM_CPU_ISA") && text.contains("avx1024"),
        "{text}"
    );
    assert!(stdout(&bad).is_empty(), "nothing ran: {}", stdout(&bad));
    let _ = std::fs::remove_dir_all(&dir);
}

/// `headroom env` answers on any machine (no GPU, no NVRTC, no MPI are lines, not errors) and
/// names what the cap and `HEADROOM_MPI` select.
#[test]
fn env_reports_the_machine_and_what_each_kernel_runs_on() {
    let run = |vars: &[(&str, &str)]| {
        let mut c = common::headroom_command();
        c.arg("env");
        for (k, v) in vars {
            c.env(k, v);
        }
        let out = c.output().unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
        stdout(&out)
    };
    let text = run(&[("HEADROOM_MPI", "")]);
    for prefix in [
        "headroom ",
        "cpu: ",
        "  instruction set: ",
        "  kernels: AdamW ",
        "memory: ",
        "cuda: ",
        "nvrtc: ",
        "nccl: ",
        "mpi: ",
    ] {
        assert!(
            text.lines().any(|l| l.starts_with(prefix)),
            "no {prefix:?} line in\n{text}"
        );
    }
    assert!(text.contains("no headroom-mpi was found"), "{text}");
    let level = headroom_tensor::isa::detected();
    assert!(
        text.contains(&format!("instruction set: {level}")),
        "{text}"
    );

    let capped = run(&[
        ("HEADROOM_CPU_ISA", "baseline"),
        ("HEADROOM_MPI", "/opt/mpi/headroom-mpi"),
    ]);
    assert!(
        capped.contains("instruction set: baseline")
            && capped.contains("AdamW baseline")
            && capped.contains("4-bit dequantization scalar")
            && capped.contains("softmax and cross-entropy rows baseline")
            && capped.contains("bf16 weights' products widened to f32"),
        "{capped}"
    );
    assert!(
        capped.contains("hands runs to /opt/mpi/headroom-mpi"),
        "{capped}"
    );
}

/// A headroom run directory given to `--init-from` stands for its newest checkpoint, as for
/// `--resume`: a longer run (which cannot resume past the warmup, its cosine decay being
/// another) starts from it.
#[test]
fn init_from_a_run_directory_starts_from_its_newest_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let tiny = [
        "--model",
        "tiny",
        "--batch",
        "2",
        "--seq",
        "16",
        "--warmup",
        "1",
        "--no-progress",
    ];
    let o = headroom(
        &[
            &["train", "--steps", "3", "--checkpoint-dir", &p("run")][..],
            &tiny[..],
        ]
        .concat(),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let longer = headroom(
        &[
            &["train", "--steps", "6", "--resume", &p("run")][..],
            &tiny[..],
        ]
        .concat(),
    );
    assert!(!longer.status.success());
    assert!(
        stderr(&longer).contains("--init-from"),
        "{}",
        stderr(&longer)
    );
    let data = p("markov.bin");
    let o = headroom(&["data", "synth", &data, "--vocab", "64", "--tokens", "20000"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let from = |source: &str| {
        let o = headroom(&[
            "train",
            "--init-from",
            source,
            "--data",
            &data,
            "--steps",
            "2",
            "--batch",
            "2",
            "--seq",
            "16",
            "--no-progress",
        ]);
        assert!(o.status.success(), "{source}: {}", stderr(&o));
        stdout(&o)
    };
    // The root and its newest step directory give the same run, loss for loss.
    let losses = |out: String| -> Vec<String> {
        out.lines()
            .filter(|l| l.starts_with("step "))
            .map(|l| l.split_whitespace().nth(3).unwrap().to_owned())
            .collect()
    };
    let via_root = losses(from(&p("run")));
    assert_eq!(via_root.len(), 2);
    assert_eq!(via_root, losses(from(&p("run/step-00000003"))));
}

/// `checkpoint verify --all` checks every step of a root: a damaged one is named and makes the
/// exit status a failure without stopping the others; `verify` of one step shows its settings.
#[test]
fn checkpoint_verify_checks_one_step_or_every_step() {
    let dir = tempfile::tempdir().unwrap();
    let run = dir.path().join("run");
    let run_s = run.to_str().unwrap();
    let o = headroom(&[
        "train",
        "--steps",
        "3",
        "--batch",
        "2",
        "--seq",
        "16",
        "--beta2",
        "0.999",
        "--checkpoint-dir",
        run_s,
        "--checkpoint-every",
        "1",
        "--no-progress",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = headroom(&["checkpoint", "verify", run_s]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("step-00000003: step 3 of 3, the model and its f32 AdamW moments"));
    assert!(out.contains("AdamW β (0.9, 0.999), ε 1e-8"), "{out}");
    assert!(out.contains("4 files match manifest.json"), "{out}");
    let o = headroom(&["checkpoint", "verify", "--all", run_s]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("3 of 3 checkpoints under"),
        "{}",
        stdout(&o)
    );

    let optimizer = run.join("step-00000002").join("optimizer.bin");
    let mut bytes = std::fs::read(&optimizer).unwrap();
    bytes[100] ^= 1;
    std::fs::write(&optimizer, &bytes).unwrap();
    let o = headroom(&["checkpoint", "verify", "--all", run_s]);
    assert!(!o.status.success());
    let out = stdout(&o);
    let line = |step: &str| out.lines().find(|l| l.starts_with(step)).unwrap_or("");
    assert!(line("step        1").contains(" ok "), "{out}");
    assert!(line("step        2").contains("DAMAGED"), "{out}");
    assert!(line("step        2").contains("optimizer.bin"), "{out}");
    assert!(line("step        3").contains(" ok "), "{out}");
    assert!(out.contains("2 of 3 checkpoints under"), "{out}");
    let o = headroom(&[
        "checkpoint",
        "verify",
        run.join("step-00000002").to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("optimizer.bin"), "{}", stderr(&o));
    let o = headroom(&[
        "checkpoint",
        "verify",
        "--all",
        dir.path().to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("no step-* directories"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn jsonl_build_writes_a_loss_mask_that_inspect_train_and_eval_apply() {
    let dir = tempfile::tempdir().unwrap();
    let tok = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/sft/llama-tokenizer.json");
    let tok = tok.to_str().unwrap();
    let jsonl = dir.path().join("sft.jsonl");
    let mut text = String::new();
    for i in 0..200 {
        text += &serde_json::json!({
            "prompt": format!("the small dog {i}"),
            "completion": " sees a red ball",
        })
        .to_string();
        text.push('\n');
    }
    std::fs::write(&jsonl, text).unwrap();
    let data = dir.path().join("sft.bin");
    let d = data.to_str().unwrap();
    let o = headroom(&[
        "data",
        "build",
        "--jsonl",
        "--tokenizer",
        tok,
        "--format",
        "raw",
        jsonl.to_str().unwrap(),
        d,
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("sft.bin.lossmask"), "{}", stdout(&o));
    let o = headroom(&["data", "inspect", d, "--dtype", "u16"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("loss mask"), "{}", stdout(&o));
    let run = dir.path().join("run");
    let o = headroom(&[
        "train",
        "--data",
        d,
        "--vocab",
        "91",
        "--channels",
        "32",
        "--steps",
        "3",
        "--batch",
        "2",
        "--seq",
        "32",
        "--no-progress",
        "--checkpoint-dir",
        run.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("\nloss mask: "), "{}", stdout(&o));
    let o = headroom(&[
        "eval",
        "--from",
        run.to_str().unwrap(),
        "--data",
        d,
        "--batch",
        "2",
        "--seq",
        "32",
        "--batches",
        "2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("kept by its loss mask"),
        "{}",
        stdout(&o)
    );
    // QLoRA on a transformers-written Llama over the same masked file.
    let base =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf-llama-gqa-untied");
    let o = headroom(&[
        "train",
        "--init-from",
        base.to_str().unwrap(),
        "--data",
        d,
        "--lora-rank",
        "4",
        "--quantize",
        "nf4",
        "--steps",
        "3",
        "--batch",
        "2",
        "--seq",
        "32",
        "--no-progress",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("\nloss mask: "), "{}", stdout(&o));
    // `sample --prompt` encodes the prompt as the examples were: the tokenizer's `<s>` first
    // (transformers' `tokenizer(prompt)`), the same continuation as those ids given directly.
    let greedy = |prompt: &[&str]| {
        let mut args = vec![
            "sample",
            "--from",
            base.to_str().unwrap(),
            "--tokenizer",
            tok,
            "--tokens",
            "4",
            "--temperature",
            "0",
            "--ignore-eot",
        ];
        args.extend_from_slice(prompt);
        let o = headroom(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        stdout(&o)
    };
    let with_bos = greedy(&["--prompt-ids", "90,26,43,85"]);
    assert_eq!(greedy(&["--prompt", "the small dog"]), with_bos);
    assert_ne!(greedy(&["--prompt-ids", "26,43,85"]), with_bos);
    // Rebuilding the file as plain text removes the mask that described the old tokens.
    let txt = dir.path().join("plain.txt");
    std::fs::write(&txt, "just some text, every token counts").unwrap();
    let o = headroom(&[
        "data",
        "build",
        "--format",
        "raw-u16",
        txt.to_str().unwrap(),
        d,
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!dir.path().join("sft.bin.lossmask").exists());
    // A JSONL line that is not an example is an error naming its line.
    std::fs::write(
        &jsonl,
        "{\"prompt\": \"a\", \"completion\": \"b\"}\n[1, 2]\n",
    )
    .unwrap();
    let o = headroom(&[
        "data",
        "build",
        "--jsonl",
        "--tokenizer",
        tok,
        jsonl.to_str().unwrap(),
        d,
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("line 2"), "{}", stderr(&o));
}

/// Two steps of a tiny model on `data`, built with the chat fixture's tokenizer (94 ids), in
/// windows of `seq` tokens.
fn train_on_chat(data: &str, seq: &str, extra: &[&str]) -> std::process::Output {
    let mut args = vec![
        "train",
        "--data",
        data,
        "--vocab",
        "94",
        "--channels",
        "32",
        "--steps",
        "2",
        "--batch",
        "2",
        "--seq",
        seq,
        "--no-progress",
    ];
    args.extend_from_slice(extra);
    headroom(&args)
}

/// `n` conversational prompt-completion lines ("Where did dog i go?" / "To the park.").
fn write_dog_questions(path: &std::path::Path, n: usize) {
    let mut text = String::new();
    for i in 0..n {
        text += &serde_json::json!({
            "prompt": [{"role": "user", "content": format!("Where did dog {i} go?")}],
            "completion": [{"role": "assistant", "content": "To the park."}],
        })
        .to_string();
        text.push('\n');
    }
    std::fs::write(path, text).unwrap();
}

/// `headroom data build --jsonl --tokenizer TOKENIZER --format FORMAT EXTRA… INPUT OUT`.
fn build_jsonl(
    tokenizer: &std::path::Path,
    format: &str,
    extra: &[&str],
    input: &std::path::Path,
    out: &std::path::Path,
) -> std::process::Output {
    let mut args = vec![
        "data",
        "build",
        "--jsonl",
        "--tokenizer",
        tokenizer.to_str().unwrap(),
        "--format",
        format,
    ];
    args.extend_from_slice(extra);
    args.extend([input.to_str().unwrap(), out.to_str().unwrap()]);
    headroom(&args)
}

/// A Parquet split (a Hugging Face dataset's file) builds the same token file and loss mask
/// as the JSONL of the rows pyarrow reads from it, and as the same split in Arrow IPC: TRL's
/// conversational and prompt-completion shapes, in row groups of 5, with a column TRL
/// ignores; a row that is not an example is named by its row.
#[test]
fn jsonl_build_reads_a_parquet_split_as_its_rows() {
    let dir = tempfile::tempdir().unwrap();
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let parquet = fixtures.join("../parquet/tests/fixtures");
    let chat = fixtures.join("tests/fixtures/sft/chat");
    let llama = fixtures.join("tests/fixtures/sft/llama-tokenizer.json");
    for (name, tokenizer, counted_all) in [
        ("sft_messages", &chat, true),
        ("sft_prompt_completion", &llama, false),
    ] {
        let mut built = Vec::new();
        for ext in ["parquet", "jsonl"] {
            let out = dir.path().join(format!("{name}-{ext}.bin"));
            let o = build_jsonl(
                tokenizer,
                "raw-u16",
                &["--quiet"],
                &parquet.join(format!("{name}.{ext}")),
                &out,
            );
            assert!(o.status.success(), "{name}.{ext}: {}", stderr(&o));
            let summary = stdout(&o);
            assert_eq!(summary.contains("(100.0%"), counted_all, "{summary}");
            let mask = dir.path().join(format!("{name}-{ext}.bin.lossmask"));
            built.push((std::fs::read(&out).unwrap(), std::fs::read(mask).unwrap()));
        }
        assert!(built[0].0.len() > 200, "{name}: {} bytes", built[0].0.len());
        assert!(
            built[0] == built[1],
            "{name}: Parquet and JSONL built differently"
        );
    }
    // The prompt-completion split as `datasets` keeps it (Arrow IPC, batches of 7) builds the
    // same token file and mask as its Parquet twin.
    let out = dir.path().join("pc-arrow.bin");
    let arrow = parquet.join("arrow/sft_prompt_completion.arrow");
    let o = build_jsonl(&llama, "raw-u16", &["--quiet"], &arrow, &out);
    assert!(o.status.success(), "{}", stderr(&o));
    let read = |p: &str| std::fs::read(dir.path().join(p)).unwrap();
    assert!(read("pc-arrow.bin") == read("sft_prompt_completion-parquet.bin"));
    assert!(read("pc-arrow.bin.lossmask") == read("sft_prompt_completion-parquet.bin.lossmask"));
    let o = build_jsonl(
        &chat,
        "raw-u16",
        &[],
        &parquet.join("mmlu_like.parquet"),
        &dir.path().join("mmlu.bin"),
    );
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("mmlu_like.parquet: row 1: an example is"),
        "{}",
        stderr(&o)
    );
    // A damaged file is a Parquet error, not a JSON one.
    let mut bytes = std::fs::read(parquet.join("sft_messages.parquet")).unwrap();
    let n = bytes.len();
    bytes[n - 8..n - 4].copy_from_slice(&u32::MAX.to_le_bytes());
    let damaged = dir.path().join("damaged.parquet");
    std::fs::write(&damaged, bytes).unwrap();
    let o = build_jsonl(&chat, "raw-u16", &[], &damaged, &dir.path().join("d.bin"));
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("corrupt Parquet file"),
        "{}",
        stderr(&o)
    );
}

/// `data inspect` of a Parquet file names its writer, rows, row groups and fields (those it
/// cannot read with why), and `--rows N` prints its first rows as the JSON lines the readers
/// see, across row groups; `--rows` of a token file is refused.
#[test]
fn inspect_shows_a_parquet_files_fields_and_rows() {
    let fixtures =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../parquet/tests/fixtures");
    let map = fixtures.join("unsupported_map.parquet");
    let o = headroom(&["data", "inspect", map.to_str().unwrap(), "--rows", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    for needle in [
        "rows         12 in 1 row groups",
        "fields       id, scores",
        "not read     scores (a MAP column)",
        "{\"id\":0}\n{\"id\":1}\n",
    ] {
        assert!(out.contains(needle), "{needle:?} in {out}");
    }
    let fineweb = fixtures.join("fineweb_like.parquet");
    let o = headroom(&["data", "inspect", fineweb.to_str().unwrap(), "--rows", "12"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("30 in 3 row groups"), "{out}");
    let want: Vec<serde_json::Value> = std::fs::read_to_string(fixtures.join("fineweb_like.jsonl"))
        .unwrap()
        .lines()
        .take(12)
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let shown: Vec<serde_json::Value> = out
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(shown, want);
    // A `datasets` cache file (Arrow IPC, as `Dataset.map` wrote it): its record batches and
    // its rows, the tokenized column a JSON array.
    let cache = fixtures.join("arrow/hf_cache_map.arrow");
    let o = headroom(&["data", "inspect", cache.to_str().unwrap(), "--rows", "2"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    for needle in [
        "format       Arrow IPC stream",
        "rows         30 in 4 record batches",
        "fields       text, id, language_score, input_ids",
    ] {
        assert!(out.contains(needle), "{needle:?} in {out}");
    }
    let want: Vec<serde_json::Value> =
        std::fs::read_to_string(fixtures.join("arrow/hf_cache_map.jsonl"))
            .unwrap()
            .lines()
            .take(2)
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
    let shown: Vec<serde_json::Value> = out
        .lines()
        .filter(|l| l.starts_with('{'))
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(shown, want);
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("t.bin");
    let o = headroom(&[
        "data",
        "synth",
        "--tokens",
        "1000",
        tokens.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = headroom(&["data", "inspect", tokens.to_str().unwrap(), "--rows", "2"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("neither Parquet nor Arrow"),
        "{}",
        stderr(&o)
    );
}

/// A Parquet or JSONL corpus without `--jsonl` is one document a record, read from `text` or
/// `--dataset-text-field`; a separator, or no tokenizer, is refused with the reason.
#[test]
fn text_build_reads_a_parquet_corpus_a_document_a_row() {
    let dir = tempfile::tempdir().unwrap();
    let corpus = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../parquet/tests/fixtures/fineweb_like.parquet");
    let corpus = corpus.to_str().unwrap();
    let out = dir.path().join("fineweb.bin");
    let out = out.to_str().unwrap();
    let o = headroom(&["data", "build", "--tokenizer", "gpt2", corpus, out]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("documents    30"), "{}", stdout(&o));
    let parquet_tokens = std::fs::read(out).unwrap();
    // The same rows as JSON lines build the same file.
    let lines = corpus.replace(".parquet", ".jsonl");
    let o = headroom(&["data", "build", "--tokenizer", "gpt2", &lines, out]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("documents    30"), "{}", stdout(&o));
    assert!(std::fs::read(out).unwrap() == parquet_tokens);
    let o = headroom(&[
        "data",
        "build",
        "--tokenizer",
        "gpt2",
        "--dataset-text-field",
        "url",
        corpus,
        out,
    ]);
    assert!(!o.status.success(), "url has a null");
    assert!(
        stderr(&o).contains("\"url\" is null, not text"),
        "{}",
        stderr(&o)
    );
    for (extra, needle) in [
        (
            &["--tokenizer", "gpt2", "--separator", "\n"][..],
            "records are its documents",
        ),
        (&[][..], "needs --tokenizer"),
    ] {
        let mut args = vec!["data", "build"];
        args.extend_from_slice(extra);
        args.extend([corpus, out]);
        let o = headroom(&args);
        assert!(!o.status.success());
        assert!(stderr(&o).contains(needle), "{}", stderr(&o));
    }
    let text = dir.path().join("plain.txt");
    std::fs::write(&text, "some text").unwrap();
    let o = headroom(&[
        "data",
        "build",
        "--tokenizer",
        "gpt2",
        "--dataset-text-field",
        "body",
        text.to_str().unwrap(),
        out,
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("line 1: not JSON"), "{}", stderr(&o));
}

/// Conversational JSONL through the command: `--tokenizer` names a directory whose
/// `tokenizer_config.json` holds the chat template; only the assistants' completions count.
#[test]
fn jsonl_build_renders_conversations_with_the_tokenizers_chat_template() {
    let dir = tempfile::tempdir().unwrap();
    let chat = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sft/chat");
    let jsonl = dir.path().join("chat.jsonl");
    write_dog_questions(&jsonl, 100);
    let data = dir.path().join("chat.bin");
    let d = data.to_str().unwrap();
    let o = build_jsonl(&chat, "raw", &[], &jsonl, &data);
    assert!(o.status.success(), "{}", stderr(&o));
    let mask = headroom_mmap_data::LossMask::open(dir.path().join("chat.bin.lossmask")).unwrap();
    // Each example: the system turn, the user's turn and the generation prompt do not count;
    // the assistant's answer and its end of turn do.
    assert!(
        mask.counted() > 0 && mask.counted() * 3 < mask.len() as u64,
        "{mask:?}"
    );
    // TRL's completion_only_loss=False: the prompts count too.
    let every = dir.path().join("every.bin");
    let o = build_jsonl(
        &chat,
        "raw",
        &["--completion-only-loss", "false"],
        &jsonl,
        &every,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let all = headroom_mmap_data::LossMask::open(dir.path().join("every.bin.lossmask")).unwrap();
    assert_eq!((all.len(), all.counted()), (mask.len(), mask.len() as u64));
    // TRL's max_length and truncation_mode: 100 examples cut to their last 8 tokens.
    let cut = |mode: &str| {
        let extra = ["--max-length", "8", "--truncation-mode", mode];
        build_jsonl(&chat, "raw", &extra, &jsonl, &every)
    };
    let o = cut("keep-end");
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("100 examples cut to 8 tokens"),
        "{}",
        stdout(&o)
    );
    let short = headroom_mmap_data::LossMask::open(dir.path().join("every.bin.lossmask")).unwrap();
    assert_eq!(short.len(), 800);
    let o = cut("middle");
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("keep-start or keep-end"),
        "{}",
        stderr(&o)
    );
    let run = dir.path().join("run");
    // A context long enough for the two-turn chat below, so its second turn can reuse the
    // first's keys and values.
    let o = train_on_chat(
        d,
        "32",
        &[
            "--checkpoint-dir",
            run.to_str().unwrap(),
            "--context",
            "256",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("\nloss mask: "), "{}", stdout(&o));
    // `sample --chat` answers a user turn rendered with the template and its generation
    // prompt: the same greedy output as those ids given directly.
    use headroom_trainer::tokenize::Tokenizer;
    let tok = Tokenizer::from_name(chat.to_str().unwrap()).unwrap();
    let turn = [serde_json::json!({"role": "user", "content": "Where did the dog go?"}).into()];
    let text = tok
        .chat_template()
        .unwrap()
        .unwrap()
        .render(&turn, true)
        .unwrap();
    assert!(text.ends_with("<|assistant|>\n"), "{text:?}");
    // The ids of a rendered text, as `--prompt-ids` takes them.
    let ids_of = |text: &str| {
        let ids: Vec<String> = tok
            .encode(text)
            .unwrap()
            .iter()
            .map(u32::to_string)
            .collect();
        ids.join(",")
    };
    let ids = ids_of(&text);
    let greedy = |prompt: &[&str]| {
        let mut args = vec![
            "sample",
            "--from",
            run.to_str().unwrap(),
            "--tokenizer",
            chat.to_str().unwrap(),
            "--tokens",
            "6",
            "--temperature",
            "0",
        ];
        args.extend_from_slice(prompt);
        let o = headroom(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        stdout(&o)
    };
    assert_eq!(
        greedy(&["--chat", "Where did the dog go?"]),
        greedy(&["--prompt-ids", &ids])
    );
    // Without a template, --chat is refused by name.
    let plain = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/sft/llama-tokenizer.json");
    let o = headroom(&[
        "sample",
        "--from",
        run.to_str().unwrap(),
        "--tokenizer",
        plain.to_str().unwrap(),
        "--chat",
        "hi",
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("chat template"), "{}", stderr(&o));
    // --chat-template renders with a template file instead (a training template with
    // generation blocks: the blocks write nothing of their own).
    let file = chat.join("../chat-jinja/chat_template.jinja");
    let text = tok
        .chat_template_from(&file)
        .unwrap()
        .render(&turn, true)
        .unwrap();
    assert_eq!(
        greedy(&[
            "--chat",
            "Where did the dog go?",
            "--chat-template",
            file.to_str().unwrap()
        ]),
        greedy(&["--prompt-ids", &ids_of(&text)])
    );
    // --conversation continues a conversation from a file; --system adds a system turn to
    // --chat's user turn: the same renders, the same tokens.
    let conversation = dir.path().join("conversation.json");
    let turns = serde_json::json!([
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Where did the dog go?"},
    ]);
    std::fs::write(&conversation, turns.to_string()).unwrap();
    let from_file = greedy(&["--conversation", conversation.to_str().unwrap()]);
    assert_eq!(
        from_file,
        greedy(&["--chat", "Where did the dog go?", "--system", "Be brief."])
    );
    std::fs::write(
        &conversation,
        serde_json::json!({"messages": turns, "chat_template_kwargs": {"x": 1}}).to_string(),
    )
    .unwrap();
    assert_eq!(
        greedy(&["--conversation", conversation.to_str().unwrap()]),
        from_file
    );
    // --chat-template-kwargs gives the template further variables (Qwen 3's enable_thinking),
    // replacing a --conversation file's of the same name.
    let shouting = dir.path().join("shout.jinja");
    std::fs::write(
        &shouting,
        "{% for m in messages %}<|user|>\n{{ m.content }}{% if shout %}!!{% endif %}{% endfor %}\
         <|assistant|>\n",
    )
    .unwrap();
    let shout_text = |shout: bool| {
        let extra = [("shout".to_owned(), serde_json::json!(shout).into())];
        tok.chat_template_from(&shouting)
            .unwrap()
            .render_request(&headroom_trainer::chat_template::ChatRequest {
                messages: &turn,
                add_generation_prompt: true,
                extra: &extra,
                ..Default::default()
            })
            .unwrap()
            .text
    };
    assert!(shout_text(true).contains("go?!!"), "{}", shout_text(true));
    let shouted = greedy(&[
        "--chat",
        "Where did the dog go?",
        "--chat-template",
        shouting.to_str().unwrap(),
        "--chat-template-kwargs",
        r#"{"shout": true}"#,
    ]);
    assert_eq!(
        shouted,
        greedy(&["--prompt-ids", &ids_of(&shout_text(true))])
    );
    std::fs::write(
        &conversation,
        serde_json::json!({"messages": [turn[0].clone()], "chat_template_kwargs": {"shout": true}})
            .to_string(),
    )
    .unwrap();
    assert_eq!(
        greedy(&[
            "--conversation",
            conversation.to_str().unwrap(),
            "--chat-template",
            shouting.to_str().unwrap(),
            "--chat-template-kwargs",
            r#"{"shout": false}"#,
        ]),
        greedy(&["--prompt-ids", &ids_of(&shout_text(false))])
    );
    // --interactive: each line of standard input is a user turn, answered through the
    // template; only the answers are printed (without their end of turn), and each joins the
    // conversation the next turn renders. The answers are the library's greedy generations of
    // those conversations.
    let chat_lines = |lines: &str, extra: &[&str]| -> (String, String) {
        use std::io::Write as _;
        let mut child = common::headroom_command()
            .args(["sample", "--from", run.to_str().unwrap(), "--tokenizer"])
            .arg(&chat)
            .args(["--tokens", "6", "--temperature", "0", "--interactive"])
            .args(extra)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(lines.as_bytes())
            .unwrap();
        let o = child.wait_with_output().unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
        (stdout(&o), stderr(&o))
    };
    let model = headroom_trainer::sample::load_model(&run, &headroom_tensor::Cpu::new()).unwrap();
    let template = tok.chat_template().unwrap().unwrap();
    let end = tok.token_id("</s>").unwrap();
    let mut so_far: Vec<headroom_trainer::chat_template::ChatValue> = Vec::new();
    let mut want = String::new();
    // The tokens whose keys and values the chat keeps after each turn, and the prompt
    // positions the next turn shares with them.
    let (mut kept, mut reused, mut prompt_tokens) = (Vec::<u32>::new(), 0, 0);
    for (i, question) in ["Where did the dog go?", "And then?"].iter().enumerate() {
        so_far.push(serde_json::json!({"role": "user", "content": question}).into());
        let text = template.render(&so_far, true).unwrap();
        let prompt = tok.encode(&text).unwrap();
        prompt_tokens += prompt.len();
        reused += kept
            .iter()
            .zip(&prompt)
            .take_while(|(a, b)| a == b)
            .count()
            .min(prompt.len() - 1);
        let opts = headroom_trainer::sample::SampleOptions {
            tokens: 6,
            sampling: headroom_trainer::sample::Sampling::greedy(),
            seed: 1337 + i as u64,
            stop_tokens: vec![end],
            vocab_limit: Some(tok.vocab_size()),
        };
        let mut new =
            headroom_trainer::sample::generate(&model, &prompt, &opts, |_| Ok(())).unwrap();
        kept = prompt
            .iter()
            .chain(&new[..new.len() - 1])
            .copied()
            .collect();
        new.retain(|&id| id != end);
        let answer = tok.decode(&new).unwrap();
        want += &format!("{answer}\n");
        so_far.push(serde_json::json!({"role": "assistant", "content": answer}).into());
    }
    assert!(want.lines().all(|answer| !answer.is_empty()), "{want:?}");
    let (out, err) = chat_lines("Where did the dog go?\nAnd then?\n", &[]);
    assert_eq!(out, want);
    // The second turn ran only what the first had not: its prompt repeats the first turn's.
    assert!(reused > 0);
    assert!(
        err.contains(&format!(
            "2 turns; {reused} of {prompt_tokens} prompt tokens reused"
        )),
        "{err}"
    );
    // --chat is the first turn; an empty line ends the chat.
    let (out, _) = chat_lines(
        "And then?\n\nnever read\n",
        &["--chat", "Where did the dog go?"],
    );
    assert_eq!(out, want);
    // --prefill is one turn's; it is refused beside --interactive.
    let o = common::headroom_command()
        .args([
            "sample",
            "--from",
            run.to_str().unwrap(),
            "--interactive",
            "--prefill",
            "x",
        ])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--prefill"), "{}", stderr(&o));
    // --prefill starts the assistant's answer, which the model continues: the conversation
    // rendered with transformers' continue_final_message (the template's end of turn cut off).
    let prefilled = [
        serde_json::json!({"role": "user", "content": "Where did the dog go?"}).into(),
        serde_json::json!({"role": "assistant", "content": "The dog"}).into(),
    ];
    let text = tok
        .chat_template()
        .unwrap()
        .unwrap()
        .render_request(&headroom_trainer::chat_template::ChatRequest {
            messages: &prefilled,
            continue_final_message: Some("content"),
            ..Default::default()
        })
        .unwrap()
        .text;
    assert!(text.ends_with("<|assistant|>\nThe dog"), "{text:?}");
    let continued = greedy(&["--chat", "Where did the dog go?", "--prefill", "The dog"]);
    assert_eq!(continued, greedy(&["--prompt-ids", &ids_of(&text)]));
    // A conversation that ends with the assistant's message is continued, as transformers'
    // text-generation pipeline does, unless --continue-final-message false asks for a new turn.
    std::fs::write(&conversation, serde_json::to_string(&prefilled).unwrap()).unwrap();
    let file = conversation.to_str().unwrap();
    assert_eq!(greedy(&["--conversation", file]), continued);
    let new_turn = tok
        .chat_template()
        .unwrap()
        .unwrap()
        .render(&prefilled, true)
        .unwrap();
    assert_eq!(
        greedy(&["--conversation", file, "--continue-final-message", "false"]),
        greedy(&["--prompt-ids", &ids_of(&new_turn)])
    );
    for (args, why) in [
        (
            vec![
                "--chat",
                "hi",
                "--prefill",
                "x",
                "--continue-final-message",
                "false",
            ],
            "--prefill is an assistant message",
        ),
        (
            vec!["--prompt", "hi", "--prefill", "x"],
            "need --chat or --conversation",
        ),
    ] {
        let mut all = vec![
            "sample",
            "--from",
            run.to_str().unwrap(),
            "--tokenizer",
            chat.to_str().unwrap(),
        ];
        all.extend(args);
        let o = headroom(&all);
        assert!(!o.status.success());
        assert!(stderr(&o).contains(why), "{}", stderr(&o));
    }
    std::fs::write(&conversation, r#"{"turns": []}"#).unwrap();
    let o = headroom(&[
        "sample",
        "--from",
        run.to_str().unwrap(),
        "--tokenizer",
        chat.to_str().unwrap(),
        "--conversation",
        conversation.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("no \"messages\" list"),
        "{}",
        stderr(&o)
    );
}

/// `data build --jsonl --assistant-only-loss`: only the assistant's turns count. The
/// tokenizer's own template has no generation blocks, so the command refuses and names
/// `--chat-template`; with a training template it counts the assistant's tokens, and warns when
/// the template leaves the end of turn outside the blocks.
#[test]
fn jsonl_build_counts_only_the_assistants_turns() {
    let dir = tempfile::tempdir().unwrap();
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sft");
    let chat = fixtures.join("chat");
    let jsonl = dir.path().join("chat.jsonl");
    let mut text = String::new();
    for i in 0..20 {
        text += &serde_json::json!({"messages": [
            {"role": "user", "content": format!("Where did dog {i} go?")},
            {"role": "assistant", "content": "To the park."},
            {"role": "user", "content": "And then?"},
            {"role": "assistant", "content": "Home."},
        ]})
        .to_string();
        text.push('\n');
    }
    std::fs::write(&jsonl, text).unwrap();
    let data = dir.path().join("chat.bin");
    let build = |tokenizer: &std::path::Path, extra: &[&str]| {
        let mut args = vec![
            "data",
            "build",
            "--jsonl",
            "--assistant-only-loss",
            "--tokenizer",
            tokenizer.to_str().unwrap(),
            "--format",
            "raw",
            jsonl.to_str().unwrap(),
            data.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        headroom(&args)
    };
    let o = build(&chat, &[]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--chat-template"), "{}", stderr(&o));
    let training = fixtures.join("chat-jinja/chat_template.jinja");
    let o = build(&chat, &["--chat-template", training.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("the assistant's turns"),
        "{}",
        stdout(&o)
    );
    assert!(!stdout(&o).contains("warning"), "{}", stdout(&o));
    let mask = headroom_mmap_data::LossMask::open(dir.path().join("chat.bin.lossmask")).unwrap();
    // Two short answers of four turns count; the rest does not.
    assert!(
        mask.counted() > 0 && mask.counted() * 3 < mask.len() as u64,
        "{mask:?}"
    );
    // `data inspect --show` decodes the start, the counted targets marked: the answers and
    // their ends of turn, not the questions.
    let o = headroom(&[
        "data",
        "inspect",
        data.to_str().unwrap(),
        "--show",
        "60",
        "--tokenizer",
        chat.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let shown = stdout(&o);
    assert!(shown.contains("the first 60 of 60 tokens"), "{shown}");
    let marked: Vec<&str> = shown
        .split("[[")
        .skip(1)
        .map(|s| s.split("]]").next().unwrap())
        .collect();
    assert!(marked.len() >= 2, "{shown}");
    assert!(marked.iter().all(|m| !m.contains("<|user|>")), "{shown}");
    assert!(marked.iter().any(|m| m.contains("</s>")), "{shown}");
    // Padded to 64 tokens, one example per window of `train --seq 64`.
    let o = build(
        &chat,
        &[
            "--chat-template",
            training.to_str().unwrap(),
            "--max-length",
            "64",
            "--pad",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("train with --seq 64"), "{}", stdout(&o));
    let padded = headroom_mmap_data::LossMask::open(dir.path().join("chat.bin.lossmask")).unwrap();
    assert_eq!(padded.len(), 20 * 64 + 1);
    let o = train_on_chat(data.to_str().unwrap(), "64", &[]);
    assert!(o.status.success(), "{}", stderr(&o));
    // A template that ends the block before the end of turn: TRL's warning (with the
    // byte-level BPE, as the chat tokenizer spells TRL's probe word with <unk>, an added token).
    let bpe = fixtures.join("../tokenizer/tokenizer.json");
    let no_eos = dir.path().join("no_eos.jinja");
    std::fs::write(
        &no_eos,
        "{% for m in messages %}<|{{ m.role }}|>\n{% if m.role == 'assistant' %}\
         {% generation %}{{ m.content }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}\
         {{ eos_token }}\n{% endfor %}",
    )
    .unwrap();
    let o = build(&bpe, &["--chat-template", no_eos.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("not trained to stop"), "{}", stdout(&o));
}

/// `train --document-attention` on an SFT file with a Megatron index: the documents are the
/// examples (one process and ZeRO ranks); a file without an index is refused by name.
#[test]
fn document_attention_trains_on_examples_of_a_megatron_file() {
    let dir = tempfile::tempdir().unwrap();
    let chat = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/sft/chat");
    let jsonl = dir.path().join("chat.jsonl");
    write_dog_questions(&jsonl, 60);
    let build = |format: &str, out: &std::path::Path| {
        let o = build_jsonl(&chat, format, &[], &jsonl, out);
        assert!(o.status.success(), "{}", stderr(&o));
    };
    let packed = dir.path().join("chat.bin");
    build("megatron", &packed);
    let o = train_on_chat(packed.to_str().unwrap(), "64", &["--document-attention"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("final loss"), "{}", stdout(&o));

    // TRL's bfd packing: whole examples in rows of 64, one row per window.
    let rows = dir.path().join("rows.bin");
    let o = build_jsonl(
        &chat,
        "megatron",
        &["--max-length", "64", "--pack"],
        &jsonl,
        &rows,
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("rows of 64 tokens"), "{}", stdout(&o));
    let o = train_on_chat(rows.to_str().unwrap(), "64", &["--document-attention"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // TRL's bfd_split: examples longer than a row split into pieces; wrapped is not a strategy
    // of --pack.
    let split = dir.path().join("split.bin");
    let pack = |strategy: &str| {
        let args = [
            "--max-length",
            "16",
            "--pack",
            "--packing-strategy",
            strategy,
        ];
        build_jsonl(&chat, "megatron", &args, &jsonl, &split)
    };
    let o = pack("bfd_split");
    assert!(o.status.success(), "{}", stderr(&o));
    let shown = stdout(&o);
    assert!(shown.contains("split into pieces of 16 tokens"), "{shown}");
    let o = train_on_chat(split.to_str().unwrap(), "16", &["--document-attention"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let o = pack("wrapped");
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("--packing-strategy wrapped"),
        "{}",
        stderr(&o)
    );

    let raw = dir.path().join("raw.bin");
    build("raw", &raw);
    let o = train_on_chat(raw.to_str().unwrap(), "64", &["--document-attention"]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("Megatron"), "{}", stderr(&o));
    assert!(
        stderr(&o).contains("--document-separator"),
        "{}",
        stderr(&o)
    );

    let o = train_on_chat(
        packed.to_str().unwrap(),
        "64",
        &["--document-attention", "--zero", "1", "--ranks", "2"],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("final loss"), "{}", stdout(&o));
}

/// `train --document-attention --document-separator 50256` on a GPT-2 text build, whose
/// documents `data build` ends with <|endoftext|>: the run counts them and trains; a separator
/// outside the vocabulary, or one without --document-attention, is refused.
#[test]
fn document_separator_trains_on_a_text_build() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("in.txt");
    let paragraphs: Vec<String> = (0..40)
        .map(|i| format!("Document {i} says the dog went to park {}.", i % 7))
        .collect();
    std::fs::write(&text, paragraphs.join("\n\n")).unwrap();
    let data = dir.path().join("text.bin");
    let o = headroom(&[
        "data",
        "build",
        text.to_str().unwrap(),
        data.to_str().unwrap(),
        "--separator",
        "\n\n",
        "--tokenizer",
        "gpt2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let run = |extra: &[&str]| {
        let mut args = vec![
            "train",
            "--data",
            data.to_str().unwrap(),
            "--vocab",
            "50257",
            "--channels",
            "16",
            "--layers",
            "1",
            "--steps",
            "2",
            "--batch",
            "2",
            "--seq",
            "32",
            "--no-progress",
            "--document-attention",
        ];
        args.extend_from_slice(extra);
        headroom(&args)
    };
    let o = run(&["--document-separator", "50256"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let shown = stdout(&o);
    assert!(
        shown.contains("documents: each ends with token 50256; 39 end in the data's"),
        "{shown}"
    );
    assert!(shown.contains("final loss"), "{shown}");
    // ZeRO's ranks read the same documents.
    let o = run(&[
        "--document-separator",
        "50256",
        "--zero",
        "2",
        "--ranks",
        "2",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("final loss"), "{}", stdout(&o));
    let o = run(&["--document-separator", "50257"]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("outside the model's vocabulary"),
        "{}",
        stderr(&o)
    );
    let o = train_on_chat(
        data.to_str().unwrap(),
        "32",
        &["--document-separator", "50256"],
    );
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("--document-attention"),
        "{}",
        stderr(&o)
    );
}

/// A dataset's shards as a directory, built into llm.c-style shards with a validation split,
/// then trained on with a glob per split: what `fineweb.py` and `train_gpt2 -i -j` do.
#[test]
fn data_build_shards_a_directory_and_train_reads_the_globs() {
    let dir = tempfile::tempdir().unwrap();
    let hub = dir.path().join("sample");
    std::fs::create_dir(&hub).unwrap();
    let fixture = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../parquet/tests/fixtures/fineweb_like.parquet");
    for shard in ["000_00000.parquet", "001_00000.parquet"] {
        std::fs::copy(&fixture, hub.join(shard)).unwrap();
    }
    let out = dir.path().join("fineweb.bin");
    let build = |extra: &[&str]| {
        let mut args = vec!["data", "build", "--tokenizer", "gpt2", "--quiet"];
        args.extend_from_slice(extra);
        args.extend([hub.to_str().unwrap(), out.to_str().unwrap()]);
        headroom(&args)
    };
    let o = build(&["--shard-tokens", "4000", "--val-shards", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let printed = stdout(&o);
    // 60 documents, 16 498 tokens: four full shards and a short one, the first for validation.
    assert!(printed.contains("documents    60"), "{printed}");
    assert!(printed.contains("inputs       2 files"), "{printed}");
    assert!(
        printed.contains("shards       5 of 4000 tokens (1 validation)"),
        "{printed}"
    );
    assert!(dir.path().join("fineweb_val_000000.bin").is_file());
    assert!(dir.path().join("fineweb_train_000004.bin").is_file());
    // A smaller rebuild removes the earlier set's tail rather than leave it to the glob.
    let o = build(&["--shard-tokens", "9000", "--val-shards", "1"]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("fineweb_train_000004.bin (an earlier build's shard)"),
        "{}",
        stdout(&o)
    );
    assert!(!dir.path().join("fineweb_train_000004.bin").exists());
    let train = dir.path().join("fineweb_train_*.bin");
    let val = dir.path().join("fineweb_val_*.bin");
    let o = headroom(&["data", "inspect", train.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("tokens      7498"), "{}", stdout(&o));
    let o = headroom(&["data", "inspect", dir.path().to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("shards      2 "), "{}", stdout(&o));
    assert!(stdout(&o).contains("tokens      16498"), "{}", stdout(&o));
    let o = headroom(&[
        "train",
        "--data",
        train.to_str().unwrap(),
        "--val-data",
        val.to_str().unwrap(),
        "--vocab",
        "50257",
        "--channels",
        "16",
        "--layers",
        "1",
        "--heads",
        "1",
        "--seq",
        "32",
        "--batch",
        "2",
        "--steps",
        "2",
        "--no-progress",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("validation loss"), "{}", stdout(&o));
    // Shards need a tokenizer; --jsonl and a token per byte read one file.
    let o = headroom(&[
        "data",
        "build",
        "--shard-tokens",
        "10",
        fixture.to_str().unwrap(),
        out.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    assert!(stderr(&o).contains("--tokenizer"), "{}", stderr(&o));
}

/// `data build --jsonl` over several files (a split's Parquet shards, compressed JSON lines)
/// is their examples one after the other: the Parquet split, its rows gzip'd, and zstd'd
/// build its own token file three times over, with three times its examples and counted
/// tokens; an input without examples is named.
#[test]
fn jsonl_build_reads_several_and_compressed_inputs_in_order() {
    use std::io::Write;
    let dir = tempfile::tempdir().unwrap();
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let parquet = fixtures.join("../parquet/tests/fixtures");
    let chat = fixtures.join("tests/fixtures/sft/chat");
    let split = parquet.join("sft_messages.parquet");
    let lines = std::fs::read(parquet.join("sft_messages.jsonl")).unwrap();
    let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    gz.write_all(&lines).unwrap();
    let gz_path = dir.path().join("rows.jsonl.gz");
    std::fs::write(&gz_path, gz.finish().unwrap()).unwrap();
    let zst_path = dir.path().join("rows.jsonl.zst");
    let fastest = ruzstd::encoding::CompressionLevel::Fastest;
    std::fs::write(
        &zst_path,
        ruzstd::encoding::compress_to_vec(&lines[..], fastest),
    )
    .unwrap();
    let single = dir.path().join("single.bin");
    let o = build_jsonl(&chat, "raw-u16", &["--quiet"], &split, &single);
    assert!(o.status.success(), "{}", stderr(&o));
    let summary = |o: &Output, key: &str| -> u64 {
        let out = stdout(o);
        let line = out
            .lines()
            .find(|l| l.starts_with(key))
            .unwrap_or_else(|| panic!("no {key} in {out}"));
        line[13..]
            .split_whitespace()
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let (examples, counted) = (summary(&o, "examples"), summary(&o, "counted"));
    let three = dir.path().join("three.bin");
    let o = headroom(&[
        "data",
        "build",
        "--jsonl",
        "--quiet",
        "--tokenizer",
        chat.to_str().unwrap(),
        "--format",
        "raw-u16",
        split.to_str().unwrap(),
        gz_path.to_str().unwrap(),
        zst_path.to_str().unwrap(),
        three.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(summary(&o, "examples"), 3 * examples);
    assert_eq!(summary(&o, "counted"), 3 * counted);
    let one = std::fs::read(&single).unwrap();
    assert!(std::fs::read(&three).unwrap() == [one.clone(), one.clone(), one].concat());
    // An empty compressed file among them is named.
    let empty = dir.path().join("empty.jsonl.gz");
    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    std::fs::write(&empty, gz.finish().unwrap()).unwrap();
    let o = headroom(&[
        "data",
        "build",
        "--jsonl",
        "--tokenizer",
        chat.to_str().unwrap(),
        split.to_str().unwrap(),
        empty.to_str().unwrap(),
        three.to_str().unwrap(),
    ]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("empty.jsonl.gz: no examples"),
        "{}",
        stderr(&o)
    );
}

/// A sharded build killed (SIGKILL) once it has finished a shard, then `--resume`d, writes
/// the same shards byte for byte as a build that was never interrupted, and leaves no
/// progress file behind.
#[test]
fn a_killed_sharded_build_resumes_to_the_same_shards() {
    let dir = tempfile::tempdir().unwrap();
    let rows = std::fs::read(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../parquet/tests/fixtures/fineweb_like.jsonl"),
    )
    .unwrap();
    let corpus = dir.path().join("corpus.jsonl");
    std::fs::write(&corpus, rows.repeat(150)).unwrap();
    let build_into = |out: &std::path::Path, resume: bool| {
        let mut command = common::headroom_command();
        command.args([
            "data",
            "build",
            "--quiet",
            "--tokenizer",
            "gpt2",
            "--shard-tokens",
            "20000",
            "--val-shards",
            "1",
        ]);
        if resume {
            command.arg("--resume");
        }
        command.args([corpus.to_str().unwrap(), out.to_str().unwrap()]);
        command
    };
    let whole = dir.path().join("whole");
    std::fs::create_dir(&whole).unwrap();
    let o = build_into(&whole.join("c.bin"), false).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let killed = dir.path().join("killed");
    std::fs::create_dir(&killed).unwrap();
    let progress = killed.join(".c.bin.build.json");
    let mut child = build_into(&killed.join("c.bin"), false)
        .stdout(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    while !progress.exists() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "the build ended before finishing a shard"
        );
        assert!(
            started.elapsed().as_secs() < 120,
            "no shard after 2 minutes"
        );
        std::thread::sleep(std::time::Duration::from_millis(2));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(progress.exists(), "the kill left the progress");
    let o = build_into(&killed.join("c.bin"), true).output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(
        stdout(&o).contains("resumed      after the"),
        "{}",
        stdout(&o)
    );
    assert!(!progress.exists());
    let (a, b) = (
        common::dir_files(&whole, None, &[]),
        common::dir_files(&killed, None, &[]),
    );
    assert!(a.len() >= 5, "{} shards", a.len());
    assert_eq!(
        a.iter().map(|f| &f.0).collect::<Vec<_>>(),
        b.iter().map(|f| &f.0).collect::<Vec<_>>()
    );
    assert!(
        a == b,
        "the resumed shards differ from the uninterrupted build's"
    );
}

/// `estimate --device cuda` says what `train --device cuda` would refuse: a Gemma 3 with heads
/// 12 wide (the device's flash kernels take 64 or 128). A shape the device runs gets no note.
#[test]
fn a_cuda_estimate_names_what_the_device_cannot_run() {
    let gemma = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf-gemma3");
    let cuda = [
        "--device",
        "cuda",
        "--precision",
        "bf16",
        "--attention",
        "flash",
        "--seq",
        "48",
        "--batch",
        "1",
    ];
    let mut args = vec!["estimate", "--init-from", gemma.to_str().unwrap()];
    args.extend(cuda);
    let o = headroom(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(
        out.contains("train --device cuda refuses this run")
            && out.contains("the CUDA flash kernels need head dimension 64 or 128, not 12"),
        "{out}"
    );
    let mut args = vec!["estimate", "--model", "llama-small"];
    args.extend(cuda);
    let o = headroom(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(!stdout(&o).contains("refuses"), "{}", stdout(&o));
}
