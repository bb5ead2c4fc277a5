//! The `headroom` command end to end: its subcommands run, print what they promise, and bad
//! input exits non-zero with the error chain.

use std::process::{Command, Output};

fn headroom(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_headroom"))
        .args(args)
        .output()
        .unwrap()
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
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let lines = std::fs::read_to_string(&metrics).unwrap();
    let rows: Vec<serde_json::Value> = lines
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 3);
    assert!(rows.iter().all(|r| r["loss"].as_f64().unwrap() > 0.0));
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
        "--budget-mib",
        "512",
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
