//! The fast paths against the plain references: every SIMD dequantization path bit-identical
//! to the scalar one (any range, odd starts, tails), and the fused forward `X·Wᵀ` and input
//! gradient `dY·W` equal to dequantize-then-multiply (f64 reference) within
//! `reference::f32_dot_tolerance`, over odd shapes, block tails, both code books, plain and
//! double quantization, and small panels (many panels, ragged last panel). The fused results
//! are also bitwise independent of the thread count.

use headroom_quant::reference::{dequantize_scalar, f32_dot_tolerance, matmul_dyw, matmul_xwt};
use headroom_quant::{
    matmul_backward_input, matmul_forward, BlockSize, Isa, MatmulOptions, QuantConfig, QuantType,
    QuantizedTensor,
};
use headroom_tensor::Cpu;
use proptest::prelude::*;

/// Deterministic values with a spread of magnitudes (a hash, so no RNG crate is needed).
fn values(n: usize, seed: u64) -> Vec<f32> {
    (0..n)
        .map(|i| {
            let mut z = (i as u64 ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15))
                .wrapping_add(0x632b_e59b_d9b4_e019);
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^= z >> 31;
            let u = (z >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
            let scale = if z & 7 == 0 { 8.0 } else { 1.0 };
            (2.0 * u - 1.0) * scale
        })
        .collect()
}

fn config(nf4: bool, bs_log2: u32, double: bool) -> QuantConfig {
    QuantConfig {
        quant_type: if nf4 { QuantType::Nf4 } else { QuantType::Fp4 },
        blocksize: BlockSize::new(1 << bs_log2).unwrap(),
        double_quant: double,
    }
}

fn check_close(got: &[f32], want: &[f32], mag: &[f64], k: usize, what: &str) {
    for (i, ((g, w), m)) in got.iter().zip(want).zip(mag).enumerate() {
        let tol = f32_dot_tolerance(k, *m);
        assert!(
            ((*g as f64) - (*w as f64)).abs() <= tol,
            "{what}: element {i}: fused {g} vs reference {w} (tolerance {tol:e})"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn simd_dequantization_equals_scalar_on_any_range(
        rows in 1usize..9, cols in 1usize..300, nf4: bool, bs_log2 in 5u32..9, double: bool,
        seed: u64, start_frac in 0.0f64..1.0, len_frac in 0.0f64..1.0,
    ) {
        let cpu = Cpu::new();
        let w = values(rows * cols, seed);
        let q = QuantizedTensor::quantize(&cpu, &w, &[rows, cols], config(nf4, bs_log2, double)).unwrap();
        let whole = dequantize_scalar(&q);
        let n = q.numel();
        let start = ((n as f64 * start_frac) as usize).min(n - 1);
        let len = ((n - start) as f64 * len_frac) as usize + 1;
        for isa in Isa::available() {
            let mut part = vec![f32::NAN; len.min(n - start)];
            q.dequantize_range_isa(isa, start, &mut part).unwrap();
            let want = &whole[start..start + part.len()];
            prop_assert!(part.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()), "{:?} range {}..+{}", isa, start, part.len());
            // The bf16 kernels: the same values rounded to nearest even.
            let mut part16 = vec![half::bf16::NAN; part.len()];
            q.dequantize_range_bf16_isa(isa, start, &mut part16).unwrap();
            prop_assert!(
                part16.iter().zip(want).all(|(a, b)| a.to_bits() == half::bf16::from_f32(*b).to_bits()),
                "bf16 {:?} range {}..+{}", isa, start, part.len()
            );
        }
        // Dequantization is within one code step of the input (sanity of the reference). The
        // codes are taken against the block's true absmax; with double quantization the
        // stored absmax is itself off by up to one step of the group's 8-bit code, which for
        // a block far below its group's mean can be several times the block's own absmax
        // (as in bitsandbytes), and a code of magnitude ≤ 1 carries that error over.
        let am = q.absmax_f32();
        let bs = q.blocksize().get();
        for (i, (d, x)) in whole.iter().zip(&w).enumerate() {
            let a = am[i / bs];
            let block = &w[i / bs * bs..((i / bs + 1) * bs).min(w.len())];
            let a_true = block.iter().fold(0f32, |m, v| m.max(v.abs()));
            let bound = 0.35 * a_true + (a - a_true).abs() + 1e-6;
            prop_assert!((d - x).abs() <= bound, "element {}: {} vs {}", i, d, x);
        }
    }

    #[test]
    fn fused_forward_and_backward_equal_dequantize_then_matmul(
        out in 1usize..40, inn in 1usize..150, n in 1usize..7, nf4: bool, bs_log2 in 5u32..8,
        double: bool, seed: u64, panel_elements in 1usize..3000, scalar: bool,
    ) {
        let cpu = Cpu::with_threads(3).unwrap();
        let w = values(out * inn, seed);
        let q = QuantizedTensor::quantize(&cpu, &w, &[out, inn], config(nf4, bs_log2, double)).unwrap();
        let wd = dequantize_scalar(&q);
        let opts = MatmulOptions {
            panel_elements,
            isa: Some(if scalar { Isa::Scalar } else { Isa::detect() }),
        };

        let x = values(n * inn, seed ^ 1);
        let mut y = vec![f32::NAN; n * out];
        matmul_forward(&cpu, &x, &q, &mut y, &opts).unwrap();
        let (y_ref, mag) = matmul_xwt(&x, &wd, n, inn, out);
        check_close(&y, &y_ref, &mag, inn, "forward");

        let dy = values(n * out, seed ^ 2);
        let mut dx = vec![f32::NAN; n * inn];
        matmul_backward_input(&cpu, &dy, &q, &mut dx, &opts).unwrap();
        let (dx_ref, mag) = matmul_dyw(&dy, &wd, n, out, inn);
        check_close(&dx, &dx_ref, &mag, out, "backward");

        // One thread gives the same bits as three.
        let one = Cpu::with_threads(1).unwrap();
        let mut y1 = vec![0f32; n * out];
        matmul_forward(&one, &x, &q, &mut y1, &opts).unwrap();
        prop_assert!(y.iter().zip(&y1).all(|(a, b)| a.to_bits() == b.to_bits()));
        let mut dx1 = vec![0f32; n * inn];
        matmul_backward_input(&one, &dy, &q, &mut dx1, &opts).unwrap();
        prop_assert!(dx.iter().zip(&dx1).all(|(a, b)| a.to_bits() == b.to_bits()));
    }
}

#[test]
fn default_panels_on_a_larger_weight_match_the_reference() {
    // Several default-sized panels (4 MiB each), a ragged last one, rows that straddle blocks.
    let cpu = Cpu::new();
    let (out, inn, n) = (700, 1500, 5);
    let w = values(out * inn, 7);
    let q = QuantizedTensor::quantize(&cpu, &w, &[out, inn], QuantConfig::qlora()).unwrap();
    let wd = dequantize_scalar(&q);
    let opts = MatmulOptions {
        panel_elements: 200 * inn,
        ..MatmulOptions::default()
    };
    let x = values(n * inn, 8);
    let mut y = vec![0f32; n * out];
    matmul_forward(&cpu, &x, &q, &mut y, &opts).unwrap();
    let (y_ref, mag) = matmul_xwt(&x, &wd, n, inn, out);
    check_close(&y, &y_ref, &mag, inn, "forward");
    let dy = values(n * out, 9);
    let mut dx = vec![0f32; n * inn];
    matmul_backward_input(&cpu, &dy, &q, &mut dx, &opts).unwrap();
    let (dx_ref, mag) = matmul_dyw(&dy, &wd, n, out, inn);
    check_close(&dx, &dx_ref, &mag, out, "backward");
}

#[test]
fn mismatched_operands_are_errors() {
    let cpu = Cpu::new();
    let q = QuantizedTensor::quantize(&cpu, &values(4 * 64, 1), &[4, 64], QuantConfig::qlora())
        .unwrap();
    let opts = MatmulOptions::default();
    let mut y = vec![0f32; 8];
    assert!(matmul_forward(&cpu, &[0.0; 63], &q, &mut y, &opts).is_err());
    assert!(matmul_forward(&cpu, &[0.0; 128], &q, &mut y[..7], &opts).is_err());
    let mut dx = vec![0f32; 128];
    assert!(matmul_backward_input(&cpu, &[0.0; 7], &q, &mut dx, &opts).is_err());
    assert!(matmul_backward_input(&cpu, &[0.0; 8], &q, &mut dx[..127], &opts).is_err());
    // Zero rows of X is an empty product, not an error.
    matmul_forward(&cpu, &[], &q, &mut [], &opts).unwrap();
    let mut out = [0f32; 10];
    assert!(q.dequantize_range(250, &mut out).is_err());
    assert!(q.dequantize_range(usize::MAX - 2, &mut out).is_err());
    let mut out16 = vec![half::bf16::ZERO; out.len()];
    assert!(q.dequantize_range_bf16(250, &mut out16).is_err());
    assert!(q.dequantize_range_bf16(usize::MAX - 2, &mut out16).is_err());
}
