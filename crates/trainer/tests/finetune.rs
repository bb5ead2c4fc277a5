//! Fine-tuning end to end with the `headroom` command, as a user does it: text is tokenised
//! with a Hugging Face `tokenizer.json` (`data build`), a `LlamaForCausalLM` written by
//! transformers is the starting point (`--init-from`), training watches a validation loss on
//! held-out text, and `sample` continues a prompt from the fine-tuned checkpoint in words.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const WORDS: [&str; 21] = [
    "the", "a", "big", "small", "red", "old", "cat", "dog", "bird", "fox", "sat", "ran", "slept",
    "jumped", "on", "under", "near", "mat", "log", "tree", "box",
];

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn headroom(args: &[&str]) -> Output {
    let o = Command::new(env!("CARGO_BIN_EXE_headroom"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "headroom {args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    o
}

/// Sentences of the toy grammar the story tokenizer was trained on (determiner, adjective,
/// noun, verb, preposition, determiner, adjective, noun), space-separated.
fn story(path: &Path, sentences: usize, seed: u64) {
    let mut state = seed;
    let mut pick = |from: &[&'static str]| {
        state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        from[(state >> 33) as usize % from.len()]
    };
    let (det, adj, verb, prep) = (&WORDS[..2], &WORDS[2..6], &WORDS[10..14], &WORDS[14..17]);
    let noun = [&WORDS[6..10], &WORDS[17..]].concat();
    let text: Vec<String> = (0..sentences)
        .map(|_| {
            format!(
                "{} {} {} {} {} {} {} {}.",
                pick(det),
                pick(adj),
                pick(&noun),
                pick(verb),
                pick(prep),
                pick(det),
                pick(adj),
                pick(&noun)
            )
        })
        .collect();
    std::fs::write(path, text.join(" ")).unwrap();
}

#[test]
fn init_from_transformers_train_with_validation_then_sample_words() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let tokenizer = fixture("tokenizer/story/tokenizer.json");
    let tokenizer = tokenizer.to_str().unwrap();
    story(&dir.path().join("train.txt"), 3000, 1);
    story(&dir.path().join("val.txt"), 300, 2);
    for split in ["train", "val"] {
        headroom(&[
            "data",
            "build",
            "--tokenizer",
            tokenizer,
            "--quiet",
            &p(&format!("{split}.txt")),
            &p(&format!("{split}.bin")),
        ]);
    }
    let base = fixture("hf-llama-gqa-untied");
    let metrics = p("metrics.jsonl");
    headroom(&[
        "train",
        "--init-from",
        base.to_str().unwrap(),
        "--data",
        &p("train.bin"),
        "--val-data",
        &p("val.bin"),
        "--eval-every",
        "20",
        "--eval-batches",
        "4",
        "--steps",
        "100",
        "--batch",
        "8",
        "--seq",
        "32",
        "--lr",
        "3e-3",
        "--checkpoint-dir",
        &p("run"),
        "--metrics",
        &metrics,
        "--no-progress",
    ]);
    let val: Vec<f64> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["val_loss"].as_f64())
        .collect();
    assert_eq!(val.len(), 5, "an evaluation every 20 steps: {val:?}");
    // The random pretrained model knows nothing of the grammar (ln 97 ≈ 4.6 nats); 100 steps
    // learn most of it.
    assert!(
        val[0] > 3.0 && val[4] < 0.6 * val[0],
        "validation losses {val:?}"
    );
    assert!(val.windows(2).all(|w| w[1] < w[0] + 0.05), "{val:?}");

    // `headroom eval` scores the checkpoint on the leading windows of the validation file
    // (what check_hf_export.py recomputes with transformers), as the library does.
    let o = headroom(&[
        "eval",
        "--from",
        &p("run"),
        "--data",
        &p("val.bin"),
        "--batch",
        "4",
        "--seq",
        "32",
        "--batches",
        "3",
    ]);
    let line = String::from_utf8(o.stdout).unwrap();
    let printed: f64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    let cpu = headroom_tensor::Cpu::new();
    let model = headroom_trainer::sample::load_model(&dir.path().join("run"), &cpu).unwrap();
    let data = headroom_mmap_data::open(
        dir.path().join("val.bin"),
        &headroom_mmap_data::OpenOptions::default(),
    )
    .unwrap();
    let (loss, tokens) = headroom_trainer::evaluate::evaluate(&model, &data, 4, 32, 3).unwrap();
    assert_eq!(tokens, 384);
    assert!((loss - printed).abs() < 1e-6, "{line}");
    assert!(
        (loss - val[4]).abs() < 0.3,
        "eval {loss} vs the run's validation {}",
        val[4]
    );
    let too_many = Command::new(env!("CARGO_BIN_EXE_headroom"))
        .args([
            "eval",
            "--from",
            &p("run"),
            "--data",
            &p("val.bin"),
            "--batches",
            "100000",
        ])
        .output()
        .unwrap();
    assert!(!too_many.status.success());

    let o = headroom(&[
        "sample",
        "--from",
        &p("run"),
        "--tokenizer",
        tokenizer,
        "--prompt",
        "the small",
        "--tokens",
        "40",
        "--seed",
        "3",
    ]);
    let text = String::from_utf8(o.stdout).unwrap();
    assert!(text.starts_with("the small"), "{text}");
    let known = text
        .split(|c: char| !c.is_ascii_lowercase())
        .filter(|w| WORDS.contains(w))
        .count();
    assert!(
        known >= 8,
        "the sample should be mostly the grammar's words: {text:?}"
    );
    // The same seed, the same text.
    let again = headroom(&[
        "sample",
        "--from",
        &p("run"),
        "--tokenizer",
        tokenizer,
        "--prompt",
        "the small",
        "--tokens",
        "40",
        "--seed",
        "3",
    ]);
    assert_eq!(String::from_utf8(again.stdout).unwrap(), text);
}

#[test]
fn sample_prints_ids_without_a_tokenizer_and_refuses_mismatches() {
    let base = fixture("hf-llama-gqa-untied");
    let base = base.to_str().unwrap();
    let o = headroom(&[
        "sample",
        "--from",
        base,
        "--prompt-ids",
        "5,6,7",
        "--tokens",
        "6",
        "--temperature",
        "0",
    ]);
    let ids: Vec<u32> = String::from_utf8(o.stdout)
        .unwrap()
        .split_whitespace()
        .map(|s| s.parse().unwrap())
        .collect();
    assert_eq!(ids.len(), 9);
    assert_eq!(&ids[..3], &[5, 6, 7]);
    assert!(ids.iter().all(|&i| i < 97));
    for bad in [
        vec!["--prompt", "text without a tokenizer"],
        vec!["--tokenizer", "gpt2"],
        vec!["--prompt-ids", "97"],
        vec!["--temperature", "-1"],
    ] {
        let o = Command::new(env!("CARGO_BIN_EXE_headroom"))
            .args(["sample", "--from", base, "--tokens", "3"])
            .args(&bad)
            .output()
            .unwrap();
        assert!(!o.status.success(), "{bad:?} should fail");
        assert!(
            String::from_utf8_lossy(&o.stderr).contains("error:"),
            "{bad:?}"
        );
    }
}
