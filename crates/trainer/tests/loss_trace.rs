//! The model's numbers do not drift: runs of the GPT-2 family give the losses (bit for bit) and
//! the tracker peaks (byte for byte) that a committed trace recorded before the model became
//! generic over the backend.
//!
//! The GEMM crate picks its kernels by the CPU's ISA and rounds differently on AVX-512 and
//! AVX2, so the fixture holds one trace per ISA. A machine whose ISA has no trace yet compares
//! within a relative tolerance instead (and says so); `HEADROOM_RECORD_TRACE=1` records its
//! trace — only ever from a commit whose numbers are known good. Our own kernels give the same
//! bits at every `HEADROOM_CPU_ISA` level, so a capped run on an AMX machine is an AVX-512
//! machine's run without AMX: that is how the `x86-64-v4` trace was recorded, and CI replays
//! it at `baseline` and `avx2`. A capped run still has gemm's AVX-512 kernels, so the
//! `x86-64-v3` trace can only come from an AVX2-only machine; it was last recorded on a Zen 4
//! VM without AVX-512 (2026-11-29: the losses of its earlier recording bit for bit; the bf16
//! run's workspace peak 192 KiB higher, since no machine had replayed that trace after the
//! AVX2 paths' later changes).

use std::collections::BTreeMap;
use std::path::PathBuf;

use headroom_attn::AttentionConfig;
use headroom_tensor::{Device, MemoryCategory};
use headroom_trainer::model::Precision;
use headroom_trainer::techniques::CheckpointChoice;
use headroom_trainer::train::{train, TrainOptions};
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
struct Trace {
    /// Every step's loss, as f32 bits.
    loss_bits: Vec<u32>,
    /// The device tracker's peak per category (in `MemoryCategory::ALL` order) and in total.
    peak: Vec<u64>,
    peak_total: u64,
}

/// ISA name → run name → trace.
type Fixture = BTreeMap<String, BTreeMap<String, Trace>>;

fn fixture_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/loss-trace.json")
}

/// The ISA level the GEMM kernels are chosen by (with `-amx` where bf16 weights take the AMX
/// products, whose numerics differ from the widening path's).
fn isa() -> &'static str {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            if headroom_trainer::ops::matmul::bf16_products() {
                return "x86-64-v4-amx";
            }
            return "x86-64-v4";
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            return "x86-64-v3";
        }
    }
    "other"
}

/// Threads every trace is recorded and replayed on: the workspace peak depends on the count
/// (attention holds one scratch per task that can run at once), so a 16-core machine would
/// otherwise see more workspace than the 2-core machines that recorded the traces.
const TRACE_THREADS: usize = 2;

fn run(o: &TrainOptions) -> Trace {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(TRACE_THREADS)
        .build()
        .unwrap();
    let report = pool.install(|| train(o, |_| {})).unwrap();
    let cpu = report.memory.device(Device::Cpu).unwrap();
    Trace {
        loss_bits: report.steps.iter().map(|s| s.loss.to_bits()).collect(),
        peak: MemoryCategory::ALL.iter().map(|&c| cpu.peak[c]).collect(),
        peak_total: cpu.peak_total,
    }
}

/// The runs: the default `headroom train`, and short runs through the low-precision paths
/// with every technique that changes what the blocks keep.
fn runs() -> Vec<(&'static str, TrainOptions)> {
    let mut bf16 = TrainOptions {
        steps: 30,
        ..TrainOptions::tiny_default()
    };
    bf16.model.layers = 3;
    bf16.techniques.model.precision = Precision::Bf16;
    bf16.techniques.model.loss_chunk = Some(100);
    bf16.techniques.model.selective = true;
    bf16.techniques.checkpoint = CheckpointChoice::EveryK(2);
    bf16.techniques.micro_batch = Some(8);
    let mut fp16 = TrainOptions {
        steps: 30,
        ..TrainOptions::tiny_default()
    };
    fp16.techniques.model.precision = Precision::Fp16;
    fp16.techniques.model.attention = AttentionConfig::naive();
    fp16.techniques.checkpoint = CheckpointChoice::SqrtN;
    vec![
        ("default", TrainOptions::tiny_default()),
        ("bf16-selective-chunked-every2-micro8", bf16),
        ("fp16-naive-sqrtn", fp16),
    ]
}

#[test]
fn gpt2_runs_match_the_committed_trace() {
    let path = fixture_path();
    let mut fixture: Fixture = match std::fs::read(&path) {
        Ok(bytes) => serde_json::from_slice(&bytes).unwrap(),
        Err(_) => Fixture::new(),
    };
    let record = std::env::var_os("HEADROOM_RECORD_TRACE").is_some();
    let isa = isa();
    let mut recorded = BTreeMap::new();
    for (name, opts) in runs() {
        let got = run(&opts);
        if record {
            recorded.insert(name.to_string(), got);
            continue;
        }
        // The peaks are this ISA's where it has a trace: the bf16 products' workspace depends
        // on the path (AMX packing, or a widened panel shaped by gemm's micro-kernel). An ISA
        // with none compares with any recorded trace.
        let any = fixture
            .get(isa)
            .and_then(|runs| runs.get(name))
            .or_else(|| fixture.values().find_map(|runs| runs.get(name)))
            .unwrap_or_else(|| panic!("no trace for {name} in {}", path.display()));
        assert_eq!(got.peak, any.peak, "{name}: peak bytes per category");
        assert_eq!(got.peak_total, any.peak_total, "{name}: peak total");
        match fixture.get(isa).and_then(|runs| runs.get(name)) {
            Some(want) => {
                assert_eq!(got.loss_bits.len(), want.loss_bits.len(), "{name}: steps");
                for (step, (g, w)) in got.loss_bits.iter().zip(&want.loss_bits).enumerate() {
                    assert_eq!(
                        g,
                        w,
                        "{name}, step {step}: loss {} != recorded {}",
                        f32::from_bits(*g),
                        f32::from_bits(*w)
                    );
                }
            }
            None => {
                eprintln!("no {isa} trace for {name}: comparing within 1e-3 relative");
                for (step, (g, w)) in got.loss_bits.iter().zip(&any.loss_bits).enumerate() {
                    let (g, w) = (f32::from_bits(*g), f32::from_bits(*w));
                    assert!(
                        (g - w).abs() <= 1e-3 * w.abs(),
                        "{name}, step {step}: loss {g} vs recorded {w}"
                    );
                }
            }
        }
    }
    if record {
        fixture.insert(isa.to_string(), recorded);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, serde_json::to_string_pretty(&fixture).unwrap()).unwrap();
        eprintln!("recorded the {isa} trace in {}", path.display());
    }
}
