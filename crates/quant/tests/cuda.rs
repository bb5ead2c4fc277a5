//! The CUDA side (feature `cuda`): the quant4 kernels compile with NVRTC for sm_80 and sm_90
//! with exactly the registered entry points (skipped without libnvrtc unless
//! `HEADROOM_REQUIRE_NVRTC=1`; `source .ci/nvrtc-env.sh`), and, on a GPU, the fused forward and
//! input gradient equal the CPU's within the stated f32 tolerance, with one panel of extra
//! device memory (ignored without a device).

#![cfg(feature = "cuda")]

use std::collections::BTreeSet;
use std::sync::Arc;

use headroom_cuda::{compile, device_count, driver_library_present, nvrtc_available, Cuda};
use headroom_profiler::MemoryTracker;
use headroom_quant::cuda::CudaQuantizedTensor;
use headroom_quant::reference::{dequantize_scalar, f32_dot_tolerance, matmul_dyw, matmul_xwt};
use headroom_quant::{BlockSize, MatmulOptions, QuantConfig, QuantType, QuantizedTensor};
use headroom_tensor::{Backend, Cpu, MemoryCategory};

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

#[test]
fn nvrtc_compiles_the_quant4_kernels_for_sm80_and_sm90() {
    if !nvrtc_or_skip("nvrtc_compiles_the_quant4_kernels_for_sm80_and_sm90") {
        return;
    }
    for module in headroom_kernels::QUANT {
        for arch in ["sm_80", "sm_90"] {
            let out = compile(module, arch).unwrap_or_else(|e| panic!("{e}"));
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
            let listed: BTreeSet<String> = module.functions.iter().map(|f| f.to_string()).collect();
            assert_eq!(entries, listed, "{}/{arch}", module.name);
            assert!(
                out.log.is_empty(),
                "{}/{arch} warnings:\n{}",
                module.name,
                out.log
            );
            // One multiply and one add per absmax, never fused: the CPU's rounding.
            assert!(
                !out.ptx.contains("fma.rn.f32"),
                "{}/{arch}: fused multiply-add",
                module.name
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn gpu_fused_matmul_matches_the_cpu() {
    assert!(
        driver_library_present() && device_count() > 0,
        "no CUDA device"
    );
    let tracker = Arc::new(MemoryTracker::new());
    let cuda = Cuda::new(0).unwrap().with_alloc_hook(tracker.clone());
    let cpu = Cpu::new();
    for (qt, double, out, inn, n) in [
        (QuantType::Nf4, true, 300usize, 257usize, 5usize),
        (QuantType::Fp4, false, 64, 1024, 3),
    ] {
        let w: Vec<f32> = (0..out * inn)
            .map(|i| ((i * 7919) % 1999) as f32 / 999.0 - 1.0)
            .collect();
        let config = QuantConfig {
            quant_type: qt,
            blocksize: BlockSize::new(64).unwrap(),
            double_quant: double,
        };
        let q = QuantizedTensor::quantize(&cpu, &w, &[out, inn], config).unwrap();
        let wd = dequantize_scalar(&q);
        let dq = CudaQuantizedTensor::upload(&cuda, &q).unwrap();
        let opts = MatmulOptions {
            panel_elements: 64 * inn,
            ..MatmulOptions::default()
        };
        let x: Vec<f32> = (0..n * inn)
            .map(|i| ((i * 31) % 97) as f32 / 97.0 - 0.5)
            .collect();
        let xd = cuda.upload(&x, [n, inn]).unwrap();
        let mut yd = cuda.zeros([n, out], headroom_tensor::DType::F32).unwrap();
        tracker.reset_peak();
        let before = tracker.snapshot();
        dq.matmul_forward(&cuda, &xd, &mut yd, &opts).unwrap();
        cuda.synchronize().unwrap();
        let y: Vec<f32> = cuda.download(&yd).unwrap();
        let (y_ref, mag) = matmul_xwt(&x, &wd, n, inn, out);
        for i in 0..y.len() {
            assert!(
                ((y[i] - y_ref[i]) as f64).abs() <= f32_dot_tolerance(inn, mag[i]),
                "forward {i}"
            );
        }
        let snap = tracker.snapshot();
        let dev = snap.device(cuda.device()).unwrap();
        let was = before.device(cuda.device()).unwrap();
        assert_eq!(
            dev.live[MemoryCategory::Workspace],
            was.live[MemoryCategory::Workspace]
        );
        assert_eq!(dev.peak[MemoryCategory::Gradients], 0);

        let mut dxd = cuda.zeros([n, inn], headroom_tensor::DType::F32).unwrap();
        dq.matmul_backward_input(&cuda, &yd, &mut dxd, &opts)
            .unwrap();
        let dx: Vec<f32> = cuda.download(&dxd).unwrap();
        let (dx_ref, mag) = matmul_dyw(&y, &wd, n, out, inn);
        for i in 0..dx.len() {
            assert!(
                ((dx[i] - dx_ref[i]) as f64).abs() <= f32_dot_tolerance(out, mag[i]),
                "backward {i}"
            );
        }
    }
}
