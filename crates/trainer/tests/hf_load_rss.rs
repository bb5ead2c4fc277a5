//! Peak resident memory while loading a Hugging Face directory: the masters plus bounded
//! read buffers, no second copy of the model. Needs a model large enough to measure, so it is
//! ignored by default:
//!
//!     HEADROOM_RSS_MODEL=DIR cargo test --release -p headroom-trainer --test hf_load_rss \
//!         -- --ignored --nocapture

use headroom_tensor::Cpu;

/// `VmHWM` (peak resident set) of this process in bytes.
fn peak_rss() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    let kib: u64 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    kib * 1024
}

#[test]
#[ignore = "needs HEADROOM_RSS_MODEL, a model directory of a few hundred MiB"]
fn loading_peaks_at_most_1_2x_the_model_bytes() {
    let dir = std::env::var_os("HEADROOM_RSS_MODEL").expect("HEADROOM_RSS_MODEL");
    let before = peak_rss();
    let (cfg, masters) = headroom_trainer::hf::load(dir.as_ref(), &Cpu::new()).unwrap();
    let after = peak_rss();
    let model_bytes: u64 = masters
        .iter()
        .map(|t| t.as_slice::<f32>().unwrap().len() as u64 * 4)
        .sum();
    let ratio = (after - before) as f64 / model_bytes as f64;
    eprintln!(
        "{} parameters, fp32 masters {:.1} MiB, peak RSS before {:.1} MiB, after {:.1} MiB: \
         {ratio:.3}× the model's bytes",
        cfg.parameter_count().unwrap(),
        model_bytes as f64 / 1048576.0,
        before as f64 / 1048576.0,
        after as f64 / 1048576.0,
    );
    assert!(
        ratio <= 1.2,
        "loading peaked at {ratio:.3}× the model's bytes"
    );
}
