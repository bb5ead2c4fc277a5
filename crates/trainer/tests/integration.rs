//! The trainer's integration tests, one module per file beside this one, built as one test
//! binary: each file alone was a binary of its own, which instantiated the trainer's generic
//! training and model code again and linked 120 MB; 33 of them were 400 s of a CI build's
//! 835 s of compiling on two cores. Run one file's tests by its module name:
//! `cargo test -p headroom-trainer --test integration -- loss_trace::`.
//!
//! The fuzz campaigns (`fuzz_*.rs`, which `scripts/fuzz-long.sh` builds one by one), and the
//! ignored measurements that must own their process (`hf_load_rss.rs` reads the process's
//! peak RSS) or read an outside corpus (`chat_template_corpus.rs`), stay binaries of their own
//! (`Cargo.toml`'s `[[test]]` list).

mod bf16_weights;
mod block_weights;
mod checkpoint_safety;
mod choices;
mod cli;
mod common;
mod corpus_metrics;
mod cuda_estimate;
mod cuda_gpt;
mod cuda_op_references;
mod cuda_train;
mod doc_templates;
mod documents;
mod estimator;
mod finetune;
mod finetune_memory;
mod generation;
mod gradient_check;
mod hf_errors;
mod hf_llama;
mod kill_resume;
mod lora_model;
mod loss_mask;
mod loss_trace;
mod lr_schedule_llmc;
mod memory_reports;
mod peft_merge;
mod sample;
mod sft_trl;
mod techniques;
mod tokenize;
mod training;
mod zero_estimate;
mod zero_train;

/// Every `tests/*.rs` file is built: a module here, or a `[[test]]` of its own in
/// `Cargo.toml`. With `autotests = false`, a file in neither would silently never run.
#[test]
fn every_test_file_is_built() {
    let crate_dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let tests = crate_dir.join("tests");
    let modules = std::fs::read_to_string(tests.join("integration.rs")).unwrap();
    let manifest = std::fs::read_to_string(crate_dir.join("Cargo.toml")).unwrap();
    let mut files = 0;
    for entry in std::fs::read_dir(&tests).unwrap() {
        let path = entry.unwrap().path();
        let Some(stem) = path.file_stem().and_then(|s| s.to_str()) else {
            continue;
        };
        if path.extension().is_none_or(|e| e != "rs") || stem == "integration" {
            continue;
        }
        files += 1;
        let module = modules.lines().any(|l| l == format!("mod {stem};"));
        let target = manifest.contains(&format!("path = \"tests/{stem}.rs\""));
        assert!(
            module != target,
            "tests/{stem}.rs: a module of tests/integration.rs ({module}) or a [[test]] of \
             its own ({target}), exactly one"
        );
    }
    assert!(files > 30, "{files} test files");
}
