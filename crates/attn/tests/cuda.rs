//! The CUDA flash attention kernels (`cuda` feature) against the CPU flash path.
//!
//! Every comparison is written once, generic over `B: AttentionBackend`: bf16 inputs through
//! `B`'s flash forward and backward, against the CPU's f32 flash forward and backward of the
//! very same (bf16-rounded) values. The `cpu_*` tests instantiate it for [`Cpu`] in bf16 and
//! run everywhere (so the body is known to pass a correct implementation, and a companion test
//! shows it rejects a wrong one); the `cuda_*` tests instantiate it for [`Cuda`] and are ignored
//! without a GPU (run them with `cargo xtask device-bundle`, or on a GPU machine with
//! `cargo test -p headroom-attn --features cuda --test cuda -- --include-ignored`).
//!
//! The tolerances are `headroom_attn::accuracy`'s (`BF16_OUTPUT`, `BF16_GRAD`, the
//! logsumexp's), the ones the GPU bench also checks before it times anything.
//!
//! Without NVRTC nothing here needs CUDA; with NVRTC (`source .ci/nvrtc-env.sh`, which also sets
//! `HEADROOM_REQUIRE_NVRTC=1` so a missing library fails instead of skipping) the attention
//! kernels are compiled for sm_80 and sm_90 and their signatures checked against the launches.
#![cfg(feature = "cuda")]

mod common;

use std::collections::BTreeSet;
use std::sync::{Arc, OnceLock};

use common::{inputs, run, Inputs, Peaks, Run, Sizes};
use headroom_attn::accuracy::{compare, compare_lse, BF16_GRAD, BF16_OUTPUT};
use headroom_attn::{
    AttentionBackend, AttentionConfig, AttnError, BackendLimit, DocumentMask, DEFAULT_FLASH_BLOCK_K,
};
use headroom_cuda::{compile, device_count, nvrtc_available, Cuda, CudaError};
use headroom_kernels::ATTENTION;
use headroom_tensor::{bf16, Backend, Cpu, DType, MemoryCategory, Tensor};
use proptest::prelude::*;

// ------------------------------------------------------------------------------------------
// The comparison, generic over the backend.

fn to_bf16(x: &[f32]) -> Vec<bf16> {
    x.iter().map(|&v| bf16::from_f32(v)).collect()
}

fn download_bf16<B: Backend>(backend: &B, t: &B::Tensor) -> Vec<f32> {
    backend
        .download::<bf16>(t)
        .unwrap()
        .into_iter()
        .map(|v| v.to_f32())
        .collect()
}

/// Flash forward and backward on `backend` from bf16 inputs, results as host f32.
fn run_bf16<B: AttentionBackend>(backend: &B, s: &Sizes, x: &Inputs, causal: bool) -> Run {
    let q = backend.upload(&to_bf16(&x.q), s.q_shape()).unwrap();
    let k = backend.upload(&to_bf16(&x.k), s.kv_shape()).unwrap();
    let v = backend.upload(&to_bf16(&x.v), s.kv_shape()).unwrap();
    let d_out = backend.upload(&to_bf16(&x.d_out), s.q_shape()).unwrap();
    let config = AttentionConfig::flash().causal(causal);
    let fwd = backend.attention_forward(&q, &k, &v, &config).unwrap();
    let g = backend
        .attention_backward(&q, &k, &v, &fwd, &d_out)
        .unwrap();
    assert_eq!(g.dq.dtype(), DType::BF16);
    assert_eq!(g.dk.shape().dims(), &s.kv_shape());
    Run {
        out: download_bf16(backend, &fwd.output),
        lse: backend.download::<f32>(&fwd.logsumexp).unwrap(),
        dq: download_bf16(backend, &g.dq),
        dk: download_bf16(backend, &g.dk),
        dv: download_bf16(backend, &g.dv),
    }
}

#[derive(Clone, Copy, Debug)]
struct Case {
    sizes: Sizes,
    causal: bool,
}

fn sizes(batch: usize, heads: (usize, usize), lens: (usize, usize), head_dim: usize) -> Sizes {
    Sizes {
        batch,
        q_heads: heads.0,
        kv_heads: heads.1,
        q_len: lens.0,
        kv_len: lens.1,
        head_dim,
    }
}

/// `got` against the f32 CPU flash reference of the same inputs.
fn check(got: &Run, want: &Run) -> Result<(), String> {
    compare("output", &got.out, &want.out, &BF16_OUTPUT)?;
    compare_lse(&got.lse, &want.lse)?;
    compare("dq", &got.dq, &want.dq, &BF16_GRAD)?;
    compare("dk", &got.dk, &want.dk, &BF16_GRAD)?;
    compare("dv", &got.dv, &want.dv, &BF16_GRAD)?;
    Ok(())
}

/// The test body: `backend`'s bf16 flash against the CPU's f32 flash, for every case.
fn matches_cpu_reference<B: AttentionBackend>(backend: &B, cases: &[Case]) {
    let cpu = Cpu::new();
    let mut failures = Vec::new();
    for (i, case) in cases.iter().enumerate() {
        let x = inputs(&case.sizes, 1000 + i as u64, DType::BF16);
        let flash = AttentionConfig::flash().causal(case.causal);
        let want = run(&cpu, &case.sizes, &x, DType::F32, &flash);
        let got = run_bf16(backend, &case.sizes, &x, case.causal);
        if let Err(e) = check(&got, &want) {
            failures.push(format!("{case:?}: {e}"));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Every sequence length the brief names (around the 64-row tiles, and long), causal and not,
/// with GQA (4 query heads on 2 key/value heads, batch 2); then plain multi-head, multi-query,
/// and unequal lengths (the bottom-right causal mask leaves rows that see no key).
fn cases(head_dim: usize, lengths: &[usize]) -> Vec<Case> {
    let mut cases = Vec::new();
    for &n in lengths {
        for causal in [false, true] {
            cases.push(Case {
                sizes: sizes(2, (4, 2), (n, n), head_dim),
                causal,
            });
        }
    }
    for (heads, lens, causal) in [
        ((2, 2), (65, 65), true),
        ((4, 1), (300, 300), false),
        ((2, 1), (65, 300), true),
        ((2, 1), (300, 65), true),
        ((2, 1), (300, 65), false),
    ] {
        cases.push(Case {
            sizes: sizes(1, heads, lens, head_dim),
            causal,
        });
    }
    cases
}

const LENGTHS: [usize; 6] = [1, 63, 64, 65, 300, 1024];

// ------------------------------------------------------------------------------------------
// The body on the CPU, everywhere.

#[test]
fn cpu_bf16_flash_passes_the_comparison() {
    // Short sequences keep this fast on CI; the CUDA tests run every length.
    let cases: Vec<Case> = cases(64, &[1, 63, 64, 65])
        .into_iter()
        .filter(|c| c.sizes.q_len.max(c.sizes.kv_len) <= 65)
        .collect();
    assert!(cases.len() >= 8);
    matches_cpu_reference(&Cpu::new(), &cases);
}

#[test]
fn the_comparison_rejects_wrong_results() {
    let cpu = Cpu::new();
    let s = sizes(1, (2, 1), (65, 65), 64);
    let x = inputs(&s, 7, DType::BF16);
    let causal = run(
        &cpu,
        &s,
        &x,
        DType::F32,
        &AttentionConfig::flash().causal(true),
    );
    let full = run_bf16(&cpu, &s, &x, false);
    assert!(
        check(&full, &causal).is_err(),
        "a non-causal result passed as causal"
    );
    // One gradient value off by 5% of the largest magnitude fails the max check.
    let mut bad = run_bf16(&cpu, &s, &x, true);
    assert!(check(&bad, &causal).is_ok());
    let largest = causal.dk.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    bad.dk[3] += 0.05 * largest;
    let e = check(&bad, &causal).unwrap_err();
    assert!(e.starts_with("dk"), "{e}");
    // A NaN anywhere fails; a finite logsumexp where -inf is due fails.
    bad.dk[3] = f32::NAN;
    assert!(check(&bad, &causal).is_err());
    let mut lse = causal.lse.clone();
    assert!(compare_lse(&lse, &causal.lse).is_ok());
    lse[0] = f32::NEG_INFINITY;
    assert!(compare_lse(&lse, &causal.lse).is_err());
    // A uniform 1% error everywhere passes the max check but not the rms check of the output.
    let scaled: Vec<f32> = causal.out.iter().map(|v| v * 1.009).collect();
    let e = compare("output", &scaled, &causal.out, &BF16_OUTPUT).unwrap_err();
    assert!(e.0.contains("rms"), "{e}");
}

// ------------------------------------------------------------------------------------------
// Without a GPU (and NVRTC): typed errors, compiled kernels.

#[test]
fn without_a_gpu_cuda_new_is_no_device_and_nothing_panics() {
    match Cuda::new(0) {
        Err(CudaError::NoDevice { reason }) => {
            assert_eq!(
                device_count(),
                0,
                "a device exists but Cuda::new failed: {reason}"
            );
            assert!(!reason.is_empty());
        }
        Err(other) => panic!("expected NoDevice, got {other:?}"),
        Ok(cuda) => {
            // A GPU machine: the smallest call runs and agrees with the CPU.
            assert!(device_count() > 0);
            let case = Case {
                sizes: sizes(1, (1, 1), (3, 3), 64),
                causal: true,
            };
            matches_cpu_reference(&cuda, &[case]);
        }
    }
}

/// False (and says why) when NVRTC cannot be loaded and the environment does not require it.
fn nvrtc_or_skip(test: &str) -> bool {
    if nvrtc_available() {
        return true;
    }
    let required = std::env::var("HEADROOM_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    assert!(
        !required,
        "HEADROOM_REQUIRE_NVRTC=1 but libnvrtc cannot be loaded"
    );
    eprintln!("{test}: skipped: libnvrtc cannot be loaded (source .ci/nvrtc-env.sh)");
    false
}

/// The PTX parameter types of entry `name`, in order (`.u64` for pointers).
fn ptx_params(ptx: &str, name: &str) -> Vec<String> {
    let start = ptx
        .find(&format!(".entry {name}("))
        .unwrap_or_else(|| panic!("{name} not in PTX"));
    let body = &ptx[start..];
    let end = body.find(')').unwrap_or(body.len());
    body[..end]
        .lines()
        .filter_map(|l| l.trim().strip_prefix(".param ."))
        .map(|rest| rest.split_whitespace().next().unwrap_or("").to_string())
        .collect()
}

/// The argument lists src/cuda.rs launches each kernel family with (see its SAFETY comments).
fn launch_signature(function: &str) -> Vec<&'static str> {
    let (pointers, tail): (usize, &[&str]) = if function.starts_with("flash_attn_fwd_") {
        // q, k, v, out, lse; q_len, kv_len, q_heads, kv_heads, scale_log2, causal
        (5, &["u32", "u32", "u32", "u32", "f32", "u32"])
    } else if function.starts_with("flash_attn_bwd_dot_") {
        // out, d_out, dot; rows (u64), head_dim
        (4, &["u32"])
    } else if function.starts_with("flash_attn_bwd_dq_") {
        // q, k, v, d_out, lse, dot, dq; sizes, scale, scale_log2, causal
        (7, &["u32", "u32", "u32", "u32", "f32", "f32", "u32"])
    } else if function.starts_with("flash_attn_bwd_dkdv_") {
        // q, k, v, d_out, lse, dot, dk, dv; sizes, scale, scale_log2, causal
        (8, &["u32", "u32", "u32", "u32", "f32", "f32", "u32"])
    } else {
        panic!("no launch signature recorded for {function}")
    };
    let mut sig = vec!["u64"; pointers];
    sig.extend_from_slice(tail);
    sig
}

#[test]
fn nvrtc_compiles_the_attention_kernels_for_sm80_and_sm90() {
    if !nvrtc_or_skip("nvrtc_compiles_the_attention_kernels_for_sm80_and_sm90") {
        return;
    }
    for arch in ["sm_80", "sm_90"] {
        for kernel in ATTENTION {
            let out = compile(kernel, arch).unwrap_or_else(|e| panic!("{e}"));
            let entries: BTreeSet<String> = out
                .ptx
                .lines()
                .filter_map(|l| l.split(".entry ").nth(1))
                .map(|r| {
                    r.chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect()
                })
                .collect();
            let listed: BTreeSet<String> = kernel.functions.iter().map(|f| f.to_string()).collect();
            assert_eq!(entries, listed, "{}/{arch}", kernel.name);
            assert!(out.ptx.contains(&format!(".target {arch}")));
            assert!(
                out.cubin.starts_with(b"\x7fELF"),
                "{}/{arch}: no CUBIN",
                kernel.name
            );
            assert!(
                out.log.is_empty(),
                "{}/{arch} warnings:\n{}",
                kernel.name,
                out.log
            );
            for function in kernel.functions {
                assert_eq!(
                    ptx_params(&out.ptx, function),
                    launch_signature(function),
                    "{function}"
                );
            }
            // The tile kernels really run on tensor cores, fed by ldmatrix and cp.async.
            for needle in [
                "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
                "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
                "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
                "cp.async.cg.shared.global",
            ] {
                assert!(
                    out.ptx.contains(needle),
                    "{}/{arch}: no {needle}",
                    kernel.name
                );
            }
            eprintln!(
                "compiled {}/{arch}: {} entries, {} B CUBIN",
                kernel.name,
                kernel.functions.len(),
                out.cubin.len()
            );
        }
    }
}

// ------------------------------------------------------------------------------------------
// On a GPU.

/// One handle for the whole test binary, so kernels are compiled and loaded once.
fn cuda() -> Cuda {
    static CUDA: OnceLock<Cuda> = OnceLock::new();
    CUDA.get_or_init(|| {
        let cuda = Cuda::new(0).expect("these tests need a CUDA device");
        headroom_attn::load_attention_kernels(&cuda).expect("the attention kernels load");
        cuda
    })
    .clone()
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_flash_matches_cpu_head_dim_64() {
    matches_cpu_reference(&cuda(), &cases(64, &LENGTHS));
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_flash_matches_cpu_head_dim_128() {
    matches_cpu_reference(&cuda(), &cases(128, &LENGTHS));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(32))]

    /// Random shapes: batch, head grouping, lengths 1..=300 (equal, fewer or more keys), both
    /// head dims, causal or not.
    #[test]
    #[ignore = "needs a CUDA device"]
    fn cuda_flash_matches_cpu_on_random_shapes(
        batch in 1usize..=2,
        kv_heads in 1usize..=2,
        group in 1usize..=3,
        q_len in 1usize..=300,
        kv_shift in 0usize..=2,
        wide in any::<bool>(),
        causal in any::<bool>(),
    ) {
        let kv_len = match kv_shift {
            0 => q_len,
            1 => (q_len / 2).max(1),
            _ => q_len + 7,
        };
        let head_dim = if wide { 128 } else { 64 };
        let case = Case {
            sizes: sizes(batch, (kv_heads * group, kv_heads), (q_len, kv_len), head_dim),
            causal,
        };
        let x = inputs(&case.sizes, q_len as u64, DType::BF16);
        let want = run(&Cpu::new(), &case.sizes, &x, DType::F32, &AttentionConfig::flash().causal(causal));
        let got = run_bf16(&cuda(), &case.sizes, &x, causal);
        prop_assert!(check(&got, &want).is_ok(), "{:?}: {:?}", case, check(&got, &want));
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_flash_ignores_the_cpu_tile_sizes() {
    // The config's block sizes steer the CPU kernels only; the CUDA result is the same bits.
    let cuda = cuda();
    let s = sizes(1, (2, 1), (130, 130), 64);
    let x = inputs(&s, 3, DType::BF16);
    let q = cuda.upload(&to_bf16(&x.q), s.q_shape()).unwrap();
    let k = cuda.upload(&to_bf16(&x.k), s.kv_shape()).unwrap();
    let v = cuda.upload(&to_bf16(&x.v), s.kv_shape()).unwrap();
    let a = AttentionConfig::flash().causal(true);
    let b = AttentionConfig::with_algorithm(headroom_attn::Algorithm::Flash {
        block_q: 7,
        block_k: DEFAULT_FLASH_BLOCK_K + 1,
    })
    .causal(true);
    let fa = cuda.attention_forward(&q, &k, &v, &a).unwrap();
    let fb = cuda.attention_forward(&q, &k, &v, &b).unwrap();
    assert_eq!(
        cuda.download::<bf16>(&fa.output).unwrap(),
        cuda.download::<bf16>(&fb.output).unwrap()
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_gradients_are_bitwise_reproducible() {
    let cuda = cuda();
    let s = sizes(2, (4, 2), (300, 300), 128);
    let x = inputs(&s, 11, DType::BF16);
    let first = run_bf16(&cuda, &s, &x, true);
    let second = run_bf16(&cuda, &s, &x, true);
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert_eq!(bits(&first.out), bits(&second.out));
    assert_eq!(bits(&first.lse), bits(&second.lse));
    assert_eq!(bits(&first.dq), bits(&second.dq));
    assert_eq!(bits(&first.dk), bits(&second.dk));
    assert_eq!(bits(&first.dv), bits(&second.dv));
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_degenerate_lengths_give_zeros_not_nan() {
    let cuda = cuda();
    let cpu = Cpu::new();
    // No keys at all; no queries at all; more queries than keys under a causal mask.
    for (lens, causal) in [((5, 0), false), ((0, 5), true), ((70, 3), true)] {
        let s = sizes(1, (2, 1), lens, 64);
        let x = inputs(&s, 5, DType::BF16);
        let want = run(
            &cpu,
            &s,
            &x,
            DType::F32,
            &AttentionConfig::flash().causal(causal),
        );
        let got = run_bf16(&cuda, &s, &x, causal);
        check(&got, &want).unwrap_or_else(|e| panic!("{lens:?}: {e}"));
        assert!(got
            .dq
            .iter()
            .chain(&got.dk)
            .chain(&got.dv)
            .all(|v| v.is_finite()));
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_rejects_what_it_has_no_kernel_for() {
    let cuda = cuda();
    let up_bf16 = |shape: [usize; 4]| {
        let n = shape.iter().product();
        cuda.upload(&vec![bf16::from_f32(0.5); n], shape).unwrap()
    };
    let flash = AttentionConfig::flash();
    let q = up_bf16([1, 2, 8, 64]);
    assert!(cuda.attention_forward(&q, &q, &q, &flash).is_ok());

    let odd = up_bf16([1, 2, 8, 96]);
    assert!(matches!(
        cuda.attention_forward(&odd, &odd, &odd, &flash),
        Err(AttnError::Unsupported {
            backend: "cuda",
            limit: BackendLimit::HeadDim { head_dim: 96, .. }
        })
    ));
    let f32s = cuda
        .upload(&vec![0.5f32; 2 * 8 * 64], [1, 2, 8, 64])
        .unwrap();
    let e = cuda
        .attention_forward(&f32s, &f32s, &f32s, &flash)
        .unwrap_err();
    assert!(matches!(
        e,
        AttnError::Unsupported {
            limit: BackendLimit::DType {
                dtype: DType::F32,
                ..
            },
            ..
        }
    ));
    assert!(
        e.to_string().contains("bf16") || e.to_string().contains("BF16"),
        "{e}"
    );
    assert!(matches!(
        cuda.attention_forward(&q, &q, &q, &AttentionConfig::naive()),
        Err(AttnError::Unsupported {
            limit: BackendLimit::Algorithm {
                requested: "naive",
                ..
            },
            ..
        })
    ));
    // The shared checks come first and read exactly as on the CPU.
    let rank3 = cuda
        .upload(&vec![bf16::from_f32(0.5); 2 * 8 * 64], [2, 8, 64])
        .unwrap();
    assert!(matches!(
        cuda.attention_forward(&rank3, &q, &q, &flash),
        Err(AttnError::NotRank4 { tensor: "q", .. })
    ));
    let mut fwd = cuda.attention_forward(&q, &q, &q, &flash).unwrap();
    let short = up_bf16([1, 2, 7, 64]);
    assert!(matches!(
        cuda.attention_backward(&q, &q, &q, &fwd, &short),
        Err(AttnError::ShapeMismatch {
            tensor: "d_out",
            ..
        })
    ));
    // No document masks: the shared checks first (a non-causal config), then Unsupported,
    // forward and (for a forward state carrying one) backward.
    let mask = DocumentMask::from_positions(1, 8, &[0, 1, 2, 0, 1, 0, 1, 2]).unwrap();
    assert!(matches!(
        cuda.attention_forward_documents(&q, &q, &q, &flash, &mask),
        Err(AttnError::InvalidConfig(_))
    ));
    let causal = flash.causal(true);
    assert!(matches!(
        cuda.attention_forward_documents(&q, &q, &q, &causal, &mask),
        Err(AttnError::Unsupported {
            backend: "cuda",
            limit: BackendLimit::DocumentMask
        })
    ));
    fwd.config = causal;
    fwd.documents = Some(mask);
    assert!(matches!(
        cuda.attention_backward(&q, &q, &q, &fwd, &q),
        Err(AttnError::Unsupported {
            limit: BackendLimit::DocumentMask,
            ..
        })
    ));
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_allocations_are_reported_in_the_cpu_categories() {
    let ledger = Arc::new(Peaks::default());
    let cuda = Cuda::new(0)
        .expect("these tests need a CUDA device")
        .with_alloc_hook(ledger.clone());
    let s = sizes(1, (4, 2), (1000, 1000), 64);
    let x = inputs(&s, 9, DType::BF16);
    let (q, k, v, d_out) = {
        let _data = MemoryCategory::Data.enter();
        (
            cuda.upload(&to_bf16(&x.q), s.q_shape()).unwrap(),
            cuda.upload(&to_bf16(&x.k), s.kv_shape()).unwrap(),
            cuda.upload(&to_bf16(&x.v), s.kv_shape()).unwrap(),
            cuda.upload(&to_bf16(&x.d_out), s.q_shape()).unwrap(),
        )
    };
    let live = |c| ledger.live(c);
    let peak = |c| ledger.peak(c);
    let rows = s.batch * s.q_heads * s.q_len;
    let fwd = {
        let _acts = MemoryCategory::Activations.enter();
        cuda.attention_forward(&q, &k, &v, &AttentionConfig::flash().causal(true))
            .unwrap()
    };
    // Output (bf16) and logsumexp (f32), both saved state here; nothing else.
    assert_eq!(
        live(MemoryCategory::Activations),
        s.q_numel() * 2 + rows * 4
    );
    assert_eq!(peak(MemoryCategory::Workspace), 0);
    let grads = {
        let _grads = MemoryCategory::Gradients.enter();
        cuda.attention_backward(&q, &k, &v, &fwd, &d_out).unwrap()
    };
    assert_eq!(
        live(MemoryCategory::Gradients),
        (s.q_numel() + 2 * s.kv_numel()) * 2
    );
    // The only scratch: one f32 per query row, freed before backward returns. O(N), not N².
    assert_eq!(peak(MemoryCategory::Workspace), rows * 4);
    assert_eq!(live(MemoryCategory::Workspace), 0);
    drop((fwd, grads));
    assert_eq!(live(MemoryCategory::Activations), 0);
    assert_eq!(live(MemoryCategory::Gradients), 0);
}
