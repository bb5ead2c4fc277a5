//! Fine-tuning end to end with the `headroom` command, as a user does it: text is tokenised
//! with a Hugging Face `tokenizer.json` (`data build`), a `LlamaForCausalLM` written by
//! transformers is the starting point (`--init-from`), training watches a validation loss on
//! held-out text, and `sample` continues a prompt from the fine-tuned checkpoint in words.

use crate::common;

use std::path::{Path, PathBuf};
use std::process::Output;

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
    let o = common::headroom_command().args(args).output().unwrap();
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

/// `train.bin` (3000 sentences) and `val.bin` (300 others) in `dir`, tokenised with
/// `tokenizer` by `headroom data build`.
fn json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn story_token_files(dir: &Path, tokenizer: &str) {
    story(&dir.join("train.txt"), 3000, 1);
    story(&dir.join("val.txt"), 300, 2);
    for split in ["train", "val"] {
        let path = |ext: &str| {
            dir.join(format!("{split}.{ext}"))
                .to_str()
                .unwrap()
                .to_owned()
        };
        let o = headroom(&[
            "data",
            "build",
            "--tokenizer",
            tokenizer,
            "--quiet",
            &path("txt"),
            &path("bin"),
        ]);
        // The same summary rows as a byte-level build, with the size actually on disk.
        let stdout = String::from_utf8(o.stdout).unwrap();
        let bytes = std::fs::metadata(path("bin")).unwrap().len();
        let first = stdout.lines().next().unwrap_or_default();
        assert_eq!(
            first,
            format!("wrote        {} ({bytes} bytes)", path("bin"))
        );
        for row in [
            "format ",
            "tokens ",
            "documents ",
            "vocabulary ",
            "text read ",
        ] {
            assert!(
                stdout.lines().any(|l| l.starts_with(row)),
                "{row}: {stdout}"
            );
        }
    }
}

#[test]
fn init_from_transformers_train_with_validation_then_sample_words() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let tokenizer = fixture("tokenizer/story/tokenizer.json");
    let tokenizer = tokenizer.to_str().unwrap();
    story_token_files(dir.path(), tokenizer);
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
    let (loss, tokens) =
        headroom_trainer::evaluate::evaluate(&model, &data, 4, 32, 3, None).unwrap();
    assert_eq!(tokens, 384);
    assert!((loss - printed).abs() < 1e-6, "{line}");
    assert!(
        (loss - val[4]).abs() < 0.3,
        "eval {loss} vs the run's validation {}",
        val[4]
    );
    let too_many = common::headroom_command()
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

    // The checkpoint carries the base's generation config: transformers' default for a Llama
    // (greedy; end of text id 2, which is this tokenizer's "."). Sampled here, through the
    // sentence ends.
    let sample = || {
        headroom(&[
            "sample",
            "--from",
            &p("run"),
            "--tokenizer",
            tokenizer,
            "--prompt",
            "the small",
            "--tokens",
            "40",
            "--temperature",
            "1",
            "--ignore-eot",
            "--seed",
            "3",
        ])
    };
    let o = sample();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("generation_config.json: sampling at temperature 1, top-k 50"),
        "{err}"
    );
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
    assert_eq!(String::from_utf8(sample().stdout).unwrap(), text);
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
    // The flag reaches the sampler: transformers' greedy `generate` with
    // `repetition_penalty=1.3` on this model (tests/fixtures/sampling.json).
    let penalised = |extra: &[&str]| {
        let mut args = vec![
            "sample",
            "--from",
            base,
            "--prompt-ids",
            "1,5,9,5",
            "--tokens",
            "8",
            "--repetition-penalty",
            "1.3",
        ];
        args.extend_from_slice(extra);
        headroom(&args)
    };
    let o = penalised(&["--temperature", "0"]);
    assert_eq!(
        String::from_utf8(o.stdout).unwrap().trim(),
        "1 5 9 5 56 34 22 54 69 70 50 69"
    );
    // The model's generation_config.json sets no do_sample: greedy unless asked otherwise, as
    // transformers' generate, and the line on stderr says so; a flag still applies.
    let o = penalised(&[]);
    assert_eq!(
        String::from_utf8(o.stdout).unwrap().trim(),
        "1 5 9 5 56 34 22 54 69 70 50 69"
    );
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("generation_config.json: greedy, repetition penalty 1.3"),
        "{err}"
    );
    // --stop ends generation after the token that completes the string, here one that starts
    // in the prompt (transformers' generate(stop_strings=["g sa"]) emits the same token:
    // tests/fixtures/sampling.json).
    let story = fixture("tokenizer/story/tokenizer.json");
    let stopped = |extra: &[&str]| {
        let mut args = vec![
            "sample",
            "--from",
            base,
            "--tokenizer",
            story.to_str().unwrap(),
            "--prompt-ids",
            "26,43,85",
            "--tokens",
            "24",
        ];
        args.extend_from_slice(extra);
        common::headroom_command().args(&args).output().unwrap()
    };
    let o = stopped(&["--stop", "g sa"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(String::from_utf8(o.stdout).unwrap(), "the small dog sat\n");
    assert!(stopped(&[]).stdout.len() > "the small dog sat\n".len());
    let o = common::headroom_command()
        .args(["sample", "--from", base, "--prompt-ids", "5", "--stop", "x"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("--stop needs a tokenizer"));
    // Its end ids, one or a list, stop generation at whichever comes first.
    let dir = tempfile::tempdir().unwrap();
    for name in ["config.json", "model.safetensors"] {
        std::fs::copy(
            fixture("hf-llama-gqa-untied").join(name),
            dir.path().join(name),
        )
        .unwrap();
    }
    std::fs::write(
        dir.path().join("generation_config.json"),
        r#"{"eos_token_id": [90, 22], "repetition_penalty": 1.3}"#,
    )
    .unwrap();
    let o = headroom(&[
        "sample",
        "--from",
        dir.path().to_str().unwrap(),
        "--prompt-ids",
        "1,5,9,5",
        "--tokens",
        "8",
    ]);
    assert_eq!(
        String::from_utf8(o.stdout).unwrap().trim(),
        "1 5 9 5 56 34 22"
    );
    std::fs::write(
        dir.path().join("generation_config.json"),
        r#"{"top_k": "x"}"#,
    )
    .unwrap();
    let o = common::headroom_command()
        .args([
            "sample",
            "--from",
            dir.path().to_str().unwrap(),
            "--tokens",
            "2",
        ])
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("top_k is \"x\", not a count"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    for bad in [
        vec!["--prompt", "text without a tokenizer"],
        vec!["--tokenizer", "gpt2"],
        vec!["--prompt-ids", "97"],
        vec!["--temperature", "-1"],
        vec!["--top-p", "1.5"],
        vec!["--min-p", "2"],
        vec!["--repetition-penalty", "0"],
    ] {
        let o = common::headroom_command()
            .args(["sample", "--from", base, "--tokens", "3"])
            .args(&bad)
            .output()
            .unwrap();
        assert!(!o.status.success(), "{bad:?} should fail");
        assert!(
            String::from_utf8_lossy(&o.stderr).contains("error:"),
            "{bad:?}"
        );
        // Refused before the prompt is echoed.
        assert!(
            o.stdout.is_empty(),
            "{bad:?}: {}",
            String::from_utf8_lossy(&o.stdout)
        );
    }
}

/// QLoRA as a user runs it: the transformers-written Llama frozen in NF4 with double
/// quantization, rank-16 adapters on every block linear, validation on held-out text. The
/// validation loss falls; the checkpoint is a PEFT adapter directory that `eval --adapter`
/// scores; `--merge-into` writes a model that scores the same; the adapter directory alone is
/// refused as a model, with a message that says what to do.
#[test]
fn qlora_on_a_pretrained_llama_lowers_the_validation_loss() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let tokenizer = fixture("tokenizer/story/tokenizer.json");
    story_token_files(dir.path(), tokenizer.to_str().unwrap());
    let base = fixture("hf-llama-gqa-untied");
    let base = base.to_str().unwrap();
    let metrics = p("metrics.jsonl");
    headroom(&[
        "train",
        "--init-from",
        base,
        "--lora-rank",
        "16",
        "--lora-alpha",
        "32",
        "--lora-targets",
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
        "--quantize",
        "nf4",
        "--double-quant",
        "--data",
        &p("train.bin"),
        "--val-data",
        &p("val.bin"),
        "--eval-every",
        "25",
        "--eval-batches",
        "4",
        "--steps",
        "100",
        "--batch",
        "8",
        "--seq",
        "32",
        "--lr",
        "1e-2",
        "--checkpoint-dir",
        &p("run"),
        "--merge-into",
        &p("merged"),
        "--metrics",
        &metrics,
        "--no-progress",
    ]);
    let val: Vec<f64> = std::fs::read_to_string(&metrics)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["val_loss"].as_f64())
        .collect();
    assert_eq!(val.len(), 4, "{val:?}");
    // The embeddings and head stay frozen (random in this fixture), so the adapters learn less
    // than full fine-tuning does; still every evaluation is lower than the one before.
    assert!(
        val.windows(2).all(|w| w[1] < w[0]),
        "validation losses {val:?}"
    );
    assert!(val[3] < val[0] - 0.3, "validation losses {val:?}");

    // The merged model carries the base's generation config, as save_pretrained writes it.
    assert!(dir.path().join("merged/generation_config.json").is_file());
    let step = dir.path().join("run/step-00000100");
    for f in [
        "adapter_config.json",
        "adapter_model.safetensors",
        "state.json",
    ] {
        assert!(step.join(f).is_file(), "{f}");
    }
    assert!(!step.join("model.safetensors").exists());
    // `checkpoint verify` knows the step for adapters and names the set-up.
    let o = headroom(&["checkpoint", "verify", step.to_str().unwrap()]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        out.contains(
            "step 100 of 100, fine-tuning adapters (PEFT's files) and their moments: LoRA r"
        ) && out.contains("base nf4"),
        "{out}"
    );
    let val_bin = p("val.bin");
    let score = |args: &[&str]| -> f64 {
        let mut all = vec!["eval", "--data", &val_bin, "--batch", "4", "--seq", "32"];
        all.extend_from_slice(args);
        let o = headroom(&all);
        String::from_utf8(o.stdout)
            .unwrap()
            .split_whitespace()
            .nth(1)
            .unwrap()
            .parse()
            .unwrap()
    };
    // The adapter merged into the fp32 base (not the 4-bit one it trained on): close to the
    // run's validation loss, and exactly what the merged directory scores.
    let with_adapter = score(&["--from", base, "--adapter", step.to_str().unwrap()]);
    let merged = score(&["--from", &p("merged")]);
    // The run's root names its newest step.
    assert_eq!(
        score(&["--from", base, "--adapter", &p("run")]),
        with_adapter
    );
    assert!(
        (with_adapter - merged).abs() < 1e-5,
        "{with_adapter} vs {merged}"
    );
    assert!(
        (with_adapter - val[3]).abs() < 0.3,
        "{with_adapter} vs {}",
        val[3]
    );
    assert!(with_adapter < 0.8 * score(&["--from", base]));

    let refused = common::headroom_command()
        .args(["eval", "--from", &p("run"), "--data", &p("val.bin")])
        .output()
        .unwrap();
    assert!(!refused.status.success());
    let msg = String::from_utf8_lossy(&refused.stderr);
    assert!(msg.contains("adapter"), "{msg}");
}

/// A LoRA checkpoint resumes bit for bit, and only on what it was trained with: a corrupted
/// adapter file, or a base whose weights changed (one bit of one weight), is refused before
/// anything is trained.
#[test]
fn lora_checkpoints_resume_exactly_and_refuse_another_base_or_a_corrupt_adapter() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let base = fixture("hf-llama-gqa-untied");
    // A copy of the base with the lowest bit of its first stored value flipped.
    let changed = dir.path().join("changed-base");
    std::fs::create_dir(&changed).unwrap();
    for f in ["config.json", "model.safetensors"] {
        std::fs::copy(base.join(f), changed.join(f)).unwrap();
    }
    let mut bytes = std::fs::read(changed.join("model.safetensors")).unwrap();
    let header = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    bytes[8 + header] ^= 1;
    std::fs::write(changed.join("model.safetensors"), bytes).unwrap();

    let run = |base: &Path, ck: &str, extra: &[&str]| {
        let mut args = vec![
            "train",
            "--init-from",
            base.to_str().unwrap(),
            "--lora-rank",
            "4",
            "--steps",
            "6",
            "--batch",
            "4",
            "--seq",
            "16",
            "--checkpoint-dir",
            ck,
            "--checkpoint-every",
            "3",
            "--no-progress",
        ];
        args.extend_from_slice(extra);
        common::headroom_command().args(&args).output().unwrap()
    };
    let whole = p("whole");
    assert!(run(&base, &whole, &[]).status.success());
    let part = p("part");
    assert!(run(&base, &part, &["--stop-after", "3"]).status.success());
    let resumed = run(&base, &part, &["--resume", &part]);
    assert!(
        resumed.status.success(),
        "{}",
        String::from_utf8_lossy(&resumed.stderr)
    );
    let adapter = |root: &str| {
        std::fs::read(Path::new(root).join("step-00000006/adapter_model.safetensors")).unwrap()
    };
    assert_eq!(adapter(&whole), adapter(&part), "resumed adapters differ");

    let other = run(
        &changed,
        &p("other"),
        &["--resume", &format!("{part}/step-00000003")],
    );
    assert!(!other.status.success());
    let msg = String::from_utf8_lossy(&other.stderr);
    assert!(msg.contains("frozen base"), "{msg}");

    let step3 = dir
        .path()
        .join("part/step-00000003/adapter_model.safetensors");
    let mut bytes = std::fs::read(&step3).unwrap();
    let last = bytes.len() - 1;
    bytes[last] ^= 0x40;
    std::fs::write(&step3, bytes).unwrap();
    let corrupt = run(
        &base,
        &p("again"),
        &["--resume", &format!("{part}/step-00000003")],
    );
    assert!(!corrupt.status.success());
    let msg = String::from_utf8_lossy(&corrupt.stderr);
    assert!(
        msg.contains("checkpoint") && msg.contains("adapter_model.safetensors"),
        "{msg}"
    );
}

/// `eval` and `sample` hold a headroom checkpoint in bf16 or 4 bits (streamed from its
/// verified files, the optimizer state unread): the loss stays near fp32's, stderr names the
/// weight bytes, and a model file changed after the save is refused by its checksum.
#[test]
fn eval_and_sample_in_bf16_and_4_bits_from_a_checkpoint_and_refuse_a_corrupt_one() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    headroom(&["data", "synth", &p("syn.bin"), "--vocab", "64"]);
    headroom(&[
        "train",
        "--model",
        "llama-tiny",
        "--steps",
        "4",
        "--data",
        &p("syn.bin"),
        "--vocab",
        "64",
        "--checkpoint-dir",
        &p("run"),
        "--checkpoint-every",
        "4",
        "--no-progress",
    ]);
    let eval = |extra: &[&str]| {
        let (run, data) = (p("run"), p("syn.bin"));
        let mut args = vec!["eval", "--from", &run, "--data", &data];
        args.extend_from_slice(extra);
        let o = headroom(&args);
        let out = String::from_utf8(o.stdout).unwrap();
        let loss: f64 = out.split_whitespace().nth(1).unwrap().parse().unwrap();
        (loss, String::from_utf8(o.stderr).unwrap())
    };
    let (fp32, err32) = eval(&[]);
    assert!(
        err32.contains("weights") && err32.contains("(fp32)"),
        "{err32}"
    );
    // Three rows of logits at a time: the same loss within f32 rounding; no row is refused.
    let (chunked, _) = eval(&["--loss-chunk", "3"]);
    assert!((chunked - fp32).abs() < 1e-5, "{chunked} vs {fp32}");
    let zero = common::headroom_command()
        .args(["eval", "--from", &p("run"), "--data", &p("syn.bin")])
        .args(["--loss-chunk", "0"])
        .output()
        .unwrap();
    assert!(!zero.status.success());
    for extra in [
        &["--precision", "bf16"][..],
        &["--precision", "bf16", "--quantize", "nf4", "--double-quant"][..],
        &["--quantize", "fp4", "--quant-blocksize", "32"][..],
    ] {
        let (loss, err) = eval(extra);
        assert!(
            (loss - fp32).abs() < 0.05,
            "{extra:?}: {loss} vs fp32 {fp32}"
        );
        assert!(err.contains("weights"), "{err}");
    }
    // One byte of the model file flipped after the save.
    let step = std::fs::read_dir(dir.path().join("run"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .unwrap()
                .to_str()
                .unwrap()
                .starts_with("step-")
        })
        .unwrap();
    let model = step.join("model.safetensors");
    let mut bytes = std::fs::read(&model).unwrap();
    let mid = bytes.len() - 100;
    bytes[mid] ^= 0x40;
    std::fs::write(&model, bytes).unwrap();
    let o = common::headroom_command()
        .args(["sample", "--from", &p("run"), "--tokens", "3"])
        .args(["--precision", "bf16"])
        .output()
        .unwrap();
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("checksum"), "{err}");
}

/// A token file made for another vocabulary is refused by name before a step runs, whether it
/// is the training data (one process or ZeRO ranks), the validation data or what `eval` scores;
/// and `eval` keeps its windows inside the model's context (its default shrinks to a short
/// context, an explicit longer `--seq` is refused).
#[test]
fn token_files_for_another_vocabulary_or_windows_past_the_context_are_refused_by_name() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    // The fixture: vocabulary 97, context 32.
    let base = fixture("hf-llama-gqa-untied");
    let base = base.to_str().unwrap();
    headroom(&["data", "synth", &p("fits.bin"), "--vocab", "97"]);
    headroom(&["data", "synth", &p("wide.bin"), "--vocab", "400"]);
    let refused = |args: &[&str]| {
        let o = common::headroom_command().args(args).output().unwrap();
        assert!(!o.status.success(), "headroom {args:?} succeeded");
        String::from_utf8_lossy(&o.stderr).into_owned()
    };
    let train = ["train", "--init-from", base, "--steps", "2", "--seq", "16"];
    for extra in [
        &["--data", &p("wide.bin"), "--checkpoint-dir", &p("run")][..],
        &["--data", &p("fits.bin"), "--val-data", &p("wide.bin")][..],
        &["--data", &p("wide.bin"), "--zero", "3", "--ranks", "2"][..],
    ] {
        let err = refused(&[&train[..], extra].concat());
        assert!(
            err.contains(&format!("{} holds token id", p("wide.bin")))
                && err.contains("the model's vocabulary of 97 ids"),
            "{extra:?}: {err}"
        );
    }
    // The refused run saved no checkpoint (its root holds only the lock file).
    let saved: Vec<_> = std::fs::read_dir(dir.path().join("run"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|name| name.starts_with("step-"))
        .collect();
    assert!(saved.is_empty(), "{saved:?}");

    let eval = ["eval", "--from", base, "--batches", "1"];
    let err = refused(&[&eval[..], &["--data", &p("wide.bin")]].concat());
    assert!(
        err.contains("outside the model's vocabulary of 97 ids"),
        "{err}"
    );
    let o = headroom(&[&eval[..], &["--data", &p("fits.bin")]].concat());
    let out = String::from_utf8(o.stdout).unwrap();
    assert!(out.contains("1 batches of 8×32"), "{out}");
    let err = refused(&[&eval[..], &["--data", &p("fits.bin"), "--seq", "33"]].concat());
    assert!(
        err.contains("longer than the model's context of 32"),
        "{err}"
    );
}

/// A run started from a Hugging Face directory carries the directory's tokenizer, its chat
/// templates and its generation config into every checkpoint and export, as a Trainer's
/// checkpoint holds them: `sample --from RUN --chat` needs no `--tokenizer`; a resume carries
/// on the checkpoint's, whatever became of the base's; full, LoRA, merged and consolidated ZeRO
/// directories all hold them; a changed file in a step directory is refused by name.
#[test]
fn checkpoints_and_exports_carry_the_base_s_tokenizer_and_generation_config() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let story_tokenizer = fixture("tokenizer/story/tokenizer.json");
    story_token_files(dir.path(), story_tokenizer.to_str().unwrap());
    let base = dir.path().join("base");
    std::fs::create_dir_all(base.join("additional_chat_templates")).unwrap();
    for f in ["config.json", "model.safetensors", "generation_config.json"] {
        std::fs::copy(fixture("hf-llama-gqa-untied").join(f), base.join(f)).unwrap();
    }
    std::fs::copy(&story_tokenizer, base.join("tokenizer.json")).unwrap();
    // transformers 5's layout: the default template and a named one in files of their own.
    std::fs::write(
        base.join("tokenizer_config.json"),
        r#"{"eos_token": "</s>"}"#,
    )
    .unwrap();
    std::fs::write(
        base.join("chat_template.jinja"),
        "{% for m in messages %}{{ m.content }} {% endfor %}{% if add_generation_prompt %}the{% endif %}",
    )
    .unwrap();
    std::fs::write(
        base.join("additional_chat_templates/tool_use.jinja"),
        "{{ tools | length }} {% for m in messages %}{{ m.content }}{% endfor %}",
    )
    .unwrap();
    let companions = [
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
        "generation_config.json",
        "additional_chat_templates/tool_use.jinja",
    ];
    let originals: Vec<Vec<u8>> = companions
        .iter()
        .map(|f| std::fs::read(base.join(f)).unwrap())
        .collect();
    let holds_them = |d: &Path| {
        for (f, bytes) in companions.iter().zip(&originals) {
            assert_eq!(
                &std::fs::read(d.join(f)).unwrap(),
                bytes,
                "{}: {f}",
                d.display()
            );
        }
        assert!(!d.join("special_tokens_map.json").exists());
        // config.json names the base's tokens, not a stand-in (the fixture's bos 1, eos 2).
        if d.join("config.json").exists() {
            let config = json(&d.join("config.json"));
            assert_eq!(
                (
                    &config["bos_token_id"],
                    &config["eos_token_id"],
                    &config["pad_token_id"]
                ),
                (&1.into(), &2.into(), &serde_json::Value::Null),
                "{}",
                d.display()
            );
        }
    };
    let listed = |step: &Path| {
        let m = json(&step.join("manifest.json"));
        let names: Vec<&str> = m["files"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["name"].as_str().unwrap())
            .collect();
        for f in companions {
            assert!(names.contains(&f), "{f} not in {names:?}");
        }
    };
    let (train_bin, run) = (p("train.bin"), p("run"));
    let train = |extra: &[&str]| {
        let mut args = vec![
            "train",
            "--data",
            &train_bin,
            "--steps",
            "4",
            "--batch",
            "4",
            "--seq",
            "16",
            "--lr",
            "1e-3",
            "--no-progress",
        ];
        args.extend_from_slice(extra);
        headroom(&args)
    };

    // Full fine-tuning, stopped after two steps.
    let base_arg = base.to_str().unwrap().to_owned();
    train(&[
        "--init-from",
        &base_arg,
        "--checkpoint-dir",
        &p("run"),
        "--checkpoint-every",
        "2",
        "--stop-after",
        "2",
    ]);
    let step2 = dir.path().join("run/step-00000002");
    holds_them(&step2);
    listed(&step2);
    headroom(&["checkpoint", "verify", &p("run")]);

    // The checkpoint's own tokenizer, chat template and generation config: the answer is the
    // one the base's files give.
    let chat = |extra: &[&str]| {
        let mut args = vec![
            "sample",
            "--from",
            &run,
            "--chat",
            "the small cat",
            "--tokens",
            "6",
        ];
        args.extend_from_slice(extra);
        headroom(&args)
    };
    let own = chat(&[]);
    let given = chat(&["--tokenizer", base.join("tokenizer.json").to_str().unwrap()]);
    assert!(!own.stdout.is_empty());
    assert_eq!(own.stdout, given.stdout);
    let err = String::from_utf8_lossy(&own.stderr);
    assert!(err.contains("generation_config.json: greedy"), "{err}");

    // The base's files changed meanwhile (a newer revision, say): the resumed run's
    // checkpoints carry on the ones its weights were trained with.
    std::fs::write(
        base.join("tokenizer_config.json"),
        r#"{"eos_token": "<unk>"}"#,
    )
    .unwrap();
    std::fs::remove_file(base.join("chat_template.jinja")).unwrap();
    train(&[
        "--init-from",
        &base_arg,
        "--resume",
        &p("run"),
        "--checkpoint-dir",
        &p("run"),
        "--checkpoint-every",
        "2",
    ]);
    let step4 = dir.path().join("run/step-00000004");
    holds_them(&step4);
    listed(&step4);
    for (f, bytes) in companions.iter().zip(&originals) {
        std::fs::write(base.join(f), bytes).unwrap();
    }

    // A tokenizer file changed after the save: refused by name, before anything is generated.
    let config = step4.join("tokenizer_config.json");
    let mut bytes = std::fs::read(&config).unwrap();
    bytes[2] ^= 1;
    std::fs::write(&config, bytes).unwrap();
    for args in [
        vec![
            "sample",
            "--from",
            &p("run"),
            "--chat",
            "the",
            "--tokens",
            "2",
        ],
        vec!["checkpoint", "verify", &p("run")],
    ] {
        let o = common::headroom_command().args(&args).output().unwrap();
        assert!(!o.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains("tokenizer_config.json"), "{args:?}: {err}");
        assert!(o.stdout.is_empty(), "{args:?}");
    }

    // LoRA: the adapter steps (a PEFT Trainer's checkpoint layout) and the merged model.
    train(&[
        "--init-from",
        &base_arg,
        "--lora-rank",
        "4",
        "--checkpoint-dir",
        &p("lora"),
        "--merge-into",
        &p("merged"),
    ]);
    holds_them(&dir.path().join("lora/step-00000004"));
    holds_them(&dir.path().join("merged"));
    headroom(&[
        "merge",
        "--base",
        &base_arg,
        "--adapter",
        &p("lora"),
        "--out",
        &p("merged-again"),
    ]);
    holds_them(&dir.path().join("merged-again"));

    // --tokenizer: another tokenizer's files in place of the base's; the base's generation
    // config stays.
    let other = dir.path().join("other-tokenizer");
    std::fs::create_dir(&other).unwrap();
    std::fs::copy(&story_tokenizer, other.join("tokenizer.json")).unwrap();
    std::fs::write(
        other.join("tokenizer_config.json"),
        r#"{"eos_token": "<unk>"}"#,
    )
    .unwrap();
    std::fs::write(
        other.join("generation_config.json"),
        r#"{"do_sample": true}"#,
    )
    .unwrap();
    train(&[
        "--init-from",
        &base_arg,
        "--tokenizer",
        other.to_str().unwrap(),
        "--checkpoint-dir",
        &p("own-tokenizer"),
    ]);
    let step = dir.path().join("own-tokenizer/step-00000004");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        assert_eq!(
            std::fs::read(step.join(f)).unwrap(),
            std::fs::read(other.join(f)).unwrap()
        );
    }
    assert_eq!(
        std::fs::read(step.join("generation_config.json")).unwrap(),
        std::fs::read(base.join("generation_config.json")).unwrap()
    );
    assert!(!step.join("chat_template.jinja").exists());
    assert!(!step.join("additional_chat_templates").exists());
    // From scratch, as a pretraining run: the checkpoint's tokenizer is what sample decodes
    // with, so the prompt comes back as text.
    train(&[
        "--vocab",
        "97",
        "--tokenizer",
        story_tokenizer.to_str().unwrap(),
        "--checkpoint-dir",
        &p("scratch"),
    ]);
    let step = dir.path().join("scratch/step-00000004");
    assert_eq!(
        std::fs::read(step.join("tokenizer.json")).unwrap(),
        std::fs::read(&story_tokenizer).unwrap()
    );
    assert!(!step.join("generation_config.json").exists());
    // Its config.json ids are the tokenizer's: the story tokenizer names no special tokens,
    // so its end of text `</s>` (id 1) is eos, and there is no bos.
    let config = json(&step.join("config.json"));
    assert_eq!(config["eos_token_id"], 1);
    assert!(config.get("bos_token_id").is_none(), "{config}");
    let o = headroom(&[
        "sample",
        "--from",
        &p("scratch"),
        "--prompt",
        "the small",
        "--tokens",
        "3",
    ]);
    assert!(String::from_utf8_lossy(&o.stdout).starts_with("the small"));
    // A tokenizer whose ids the model cannot embed, or a file that is not one, is refused
    // before training.
    for (extra, why) in [
        (
            vec!["--vocab", "50"],
            "more than the model's vocabulary of 50",
        ),
        (vec!["--vocab", "97", "--tokenizer", "gpt2"], "built in"),
    ] {
        let mut args = vec![
            "train",
            "--data",
            &train_bin,
            "--steps",
            "1",
            "--batch",
            "2",
            "--seq",
            "8",
            "--checkpoint-dir",
            &run,
        ];
        if extra.len() == 2 {
            args.extend(["--tokenizer", story_tokenizer.to_str().unwrap()]);
        }
        args.extend(extra.iter().copied());
        let o = common::headroom_command().args(&args).output().unwrap();
        assert!(!o.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(why), "{args:?}: {err}");
    }

    // ZeRO: rank 0 writes them beside the shards; a consolidation keeps them.
    train(&[
        "--init-from",
        &base_arg,
        "--zero",
        "3",
        "--ranks",
        "2",
        "--checkpoint-dir",
        &p("zero"),
    ]);
    holds_them(&dir.path().join("zero/step-00000004"));
    listed(&dir.path().join("zero/step-00000004"));
    headroom(&["checkpoint", "consolidate", &p("zero"), &p("consolidated")]);
    holds_them(&dir.path().join("consolidated/step-00000004"));
    headroom(&["checkpoint", "verify", &p("consolidated")]);
}

/// `train --eos-token` and `--chat-template` leave in every checkpoint what TRL's
/// `SFTTrainer.save_model` writes with `SFTConfig(eos_token=…, chat_template_path=…)`
/// (`benches/torch/make_trl_saved_tokenizer_fixture.py`): the tokenizer's `eos_token`, the
/// model's eos id in `config.json`, the generation config's eos ids with the new one in front,
/// and the training template as the only chat template. A resume with the same options changes
/// nothing; one without them carries them on. TRL also makes the eos token the pad token
/// (its collator needs one); headroom keeps the base's pad token, which the test checks too.
#[test]
fn eos_token_and_chat_template_change_the_carried_tokenizer_as_trl_saves_it() {
    use headroom_trainer::chat_template::{ChatRequest, ChatTemplate, ChatValue};
    let fixture_json = json(&fixture("sft/trl_saved_tokenizer.json"));
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();
    let story_tokenizer = fixture("tokenizer/story/tokenizer.json");
    story_token_files(dir.path(), story_tokenizer.to_str().unwrap());
    let train_bin = p("train.bin");
    let train = |extra: &[&str]| {
        let mut args = vec![
            "train",
            "--data",
            &train_bin,
            "--steps",
            "2",
            "--batch",
            "2",
            "--seq",
            "8",
            "--no-progress",
        ];
        args.extend_from_slice(extra);
        headroom(&args)
    };
    // What a template renders for a conversation, as the text of its default template.
    let messages: Vec<ChatValue> = serde_json::from_str(
        r#"[{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat."}]"#,
    )
    .unwrap();
    let render = |t: &ChatTemplate| {
        t.render_request(&ChatRequest {
            messages: &messages,
            add_generation_prompt: false,
            ..Default::default()
        })
        .unwrap()
        .text
    };
    let mut cases = 0;
    for (name, case) in fixture_json["cases"].as_object().unwrap() {
        let base = dir.path().join(format!("base-{name}"));
        std::fs::create_dir_all(base.join("additional_chat_templates")).unwrap();
        for f in ["config.json", "model.safetensors"] {
            std::fs::copy(fixture("hf-llama-gqa-untied").join(f), base.join(f)).unwrap();
        }
        std::fs::copy(&story_tokenizer, base.join("tokenizer.json")).unwrap();
        for (file, text) in case["base_files"].as_object().unwrap() {
            match text.as_str() {
                Some(text) => std::fs::write(base.join(file), text).unwrap(),
                None => {
                    std::fs::copy(fixture("hf-llama-gqa-untied").join(file), base.join(file))
                        .unwrap();
                }
            }
        }
        let settings = &case["settings"];
        let eos = settings["eos_token"].as_str().unwrap();
        let template = settings["chat_template_path"]
            .as_str()
            .map(|t| fixture("sft").join(t).to_str().unwrap().to_owned());
        let run = p(&format!("run-{name}"));
        let mut args = vec![
            "--init-from",
            base.to_str().unwrap(),
            "--eos-token",
            eos,
            "--checkpoint-dir",
            &run,
            "--checkpoint-every",
            "1",
            "--stop-after",
            "1",
        ];
        if let Some(t) = &template {
            args.extend(["--chat-template", t]);
        }
        train(&args);
        let step1 = Path::new(&run).join("step-00000001");
        let saved = &case["saved"];

        // The carried files: TRL's, apart from where transformers 5 moves an inline template
        // into chat_template.jinja on saving (headroom carries the base's files as they are).
        let mut files: Vec<String> = std::fs::read_dir(&step1)
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .filter(|n| headroom_trainer::companions::is_companion(n))
            .collect();
        if step1.join("additional_chat_templates").exists() {
            files.push("additional_chat_templates".into());
        }
        files.sort();
        let mut trl_files: Vec<String> = saved["files"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f.as_str().unwrap().to_owned())
            .collect();
        let inline = case["base_files"]["tokenizer_config.json"]
            .as_str()
            .unwrap()
            .contains("chat_template");
        if inline && template.is_none() {
            trl_files.retain(|f| f != "chat_template.jinja");
        }
        assert_eq!(files, trl_files, "{name}");

        let config = json(&step1.join("config.json"));
        let generation = json(&step1.join("generation_config.json"));
        let tokenizer_config = json(&step1.join("tokenizer_config.json"));
        for key in ["bos_token_id", "eos_token_id"] {
            assert_eq!(config[key], saved["config"][key], "{name}: config {key}");
            assert_eq!(
                generation[key], saved["generation_config"][key],
                "{name}: generation {key}"
            );
        }
        // TRL's pad token is its eos; headroom keeps the base's (none).
        assert_eq!(
            saved["config"]["pad_token_id"],
            saved["config"]["eos_token_id"]
        );
        assert_eq!(config["pad_token_id"], serde_json::Value::Null, "{name}");
        for key in ["eos_token", "unk_token"] {
            assert_eq!(
                tokenizer_config[key], saved["tokenizer_config"][key],
                "{name}: {key}"
            );
        }
        // The chat template renders as TRL's saved one does.
        let tokenizer_json = step1.join("tokenizer.json");
        let ours = ChatTemplate::beside(&tokenizer_json).unwrap();
        match saved["chat_template_jinja"].as_str() {
            None => assert!(ours.is_none(), "{name}"),
            Some(text) => {
                let ours = ours.unwrap();
                let theirs_file = dir.path().join(format!("trl-{name}.jinja"));
                std::fs::write(&theirs_file, text).unwrap();
                let theirs = ChatTemplate::from_file(&theirs_file, Some(&tokenizer_json)).unwrap();
                assert_eq!(render(&ours), render(&theirs), "{name}");
                if template.is_some() {
                    assert!(render(&ours).ends_with(&format!("sat.{eos}")), "{name}");
                }
            }
        }

        // Resumed with the same options: the same files (the eos id is not added twice).
        train(&[
            "--init-from",
            base.to_str().unwrap(),
            "--eos-token",
            eos,
            "--resume",
            &run,
            "--checkpoint-dir",
            &run,
            "--checkpoint-every",
            "1",
        ]);
        let step2 = Path::new(&run).join("step-00000002");
        for f in files.iter().filter(|f| !f.starts_with("additional")) {
            assert_eq!(
                std::fs::read(step1.join(f)).unwrap(),
                std::fs::read(step2.join(f)).unwrap(),
                "{name}: {f}"
            );
        }
        assert_eq!(json(&step2.join("config.json")), config, "{name}");
        // The checkpoint samples with them: its generation config stops at the new eos.
        let o = headroom(&["sample", "--from", &run, "--prompt", "the", "--tokens", "2"]);
        assert!(o.status.success());
        cases += 1;
    }
    assert_eq!(cases, 3);

    // Refused before any step: a token the vocabulary lacks, and a run with no tokenizer.
    let base = p("base-added_eos");
    for (extra, why) in [
        (
            vec!["--init-from", base.as_str(), "--eos-token", "<|im_end|>"],
            "not in the tokenizer's vocabulary",
        ),
        (vec!["--vocab", "97", "--eos-token", "</s>"], "carries none"),
        (
            vec![
                "--init-from",
                base.as_str(),
                "--chat-template",
                "/nonexistent.jinja",
            ],
            "nonexistent.jinja",
        ),
    ] {
        let mut args = vec![
            "train", "--data", &train_bin, "--steps", "1", "--batch", "2", "--seq", "8",
        ];
        args.extend(extra.iter().copied());
        let o = common::headroom_command().args(&args).output().unwrap();
        assert!(!o.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(why), "{args:?}: {err}");
        assert!(
            !String::from_utf8_lossy(&o.stdout).contains("step "),
            "{args:?}"
        );
    }
}
