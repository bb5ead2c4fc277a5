//! Loading a Hugging Face directory: peak resident memory is the masters plus bounded read
//! buffers, no second copy of the model; the time is at most twice that of reading its files.
//! Needs a model large enough to measure, so both are ignored by default (a GPT-2 small:
//! `python benches/torch/make_llama_fixture.py --gpt2-124m DIR`):
//!
//!     HEADROOM_RSS_MODEL=DIR cargo test --release -p headroom-trainer --test hf_load_rss \
//!         -- --ignored --nocapture --test-threads 1

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

/// The model's safetensors files (one, or the shards beside an index).
fn model_files(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            let name = p.file_name().unwrap().to_string_lossy();
            name.starts_with("model") && name.ends_with(".safetensors")
        })
        .collect();
    files.sort();
    files
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Load time against the time to read the same files into memory, page cache warm for both,
/// alternating, medians of 7: what the conversion (transposes, widening, the masters' writes)
/// costs on top of the bytes themselves.
#[test]
#[ignore = "needs HEADROOM_RSS_MODEL, a model directory of a few hundred MiB"]
fn loading_takes_at_most_2x_reading_the_files() {
    use std::time::Instant;
    let dir = std::env::var_os("HEADROOM_RSS_MODEL").expect("HEADROOM_RSS_MODEL");
    let dir = std::path::Path::new(&dir);
    let files = model_files(dir);
    assert!(
        !files.is_empty(),
        "no model*.safetensors in {}",
        dir.display()
    );
    let cpu = Cpu::new();
    let read = || {
        let t = Instant::now();
        let bytes: usize = files.iter().map(|f| std::fs::read(f).unwrap().len()).sum();
        (t.elapsed().as_secs_f64(), bytes)
    };
    let load = || {
        let t = Instant::now();
        let (_, masters) = headroom_trainer::hf::load(dir, &cpu).unwrap();
        let secs = t.elapsed().as_secs_f64();
        drop(masters);
        secs
    };
    let (_, bytes) = read();
    load();
    let (mut reads, mut loads) = (vec![], vec![]);
    for _ in 0..7 {
        reads.push(read().0);
        loads.push(load());
    }
    let (r, l) = (median(reads), median(loads));
    eprintln!(
        "{:.1} MiB in {} file(s): read {:.3} s ({:.2} GB/s), load {:.3} s: {:.2}× the read",
        bytes as f64 / 1048576.0,
        files.len(),
        r,
        bytes as f64 / r / 1e9,
        l,
        l / r
    );
    assert!(l <= 2.0 * r, "loading took {:.2}× the read", l / r);
}
