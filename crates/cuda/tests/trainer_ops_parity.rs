//! The trainer ops and GEMMs on the device against scalar CPU references.
//!
//! The references below are plain scalar code written for this test, each a transcription of
//! the CPU code it stands for (headroom-trainer's `ops`, headroom-offload's `reference.rs`,
//! headroom-amp's `stochastic_rounding.rs`). This crate depends on none of those, so the
//! non-ignored `*_match_the_crates_they_transcribe` tests pin the bitwise ones to golden values
//! printed by the real crates (GELU, AdamW, the rounding hash and its roundings).
//!
//! The GPU tests are `#[ignore = "needs a CUDA device"]`; each states its tolerance:
//! - bitwise: embedding forward and backward, GELU forward and backward, residual add, AdamW
//!   (f32 and bf16 gradients, with and without the bf16 copy), stochastic rounding, and the
//!   attention-head permutes (split and merge, every unit size, against plain loops);
//! - to rounding, against f64 references: GEMMs (the worst-case bound of an f32 sum of k
//!   products in any order, γ_k·Σ|a·b|, plus one output rounding), layer norm, cross-entropy
//!   and bias-gradient column sums (relative tolerances stated at each check);
//! - every op is also run twice and must give the same bits (deterministic reductions).

use std::sync::{Arc, Mutex};

use headroom_cuda::{
    AdamWStep, Cuda, CudaTensor, GemmOp, GemmShape, HeadLayout, StochasticRoundingKey,
};
use headroom_tensor::{
    bf16, f16, AllocEvent, AllocHook, Backend, BoxedError, DType, Element, Error, MemoryCategory,
};

mod common;

use common::*;

// ------------------------------------------------------------------------------------------
// Device helpers.

fn cuda() -> Cuda {
    Cuda::new(0).expect("this test needs a CUDA device")
}

fn up<T: Element>(cuda: &Cuda, data: &[T]) -> CudaTensor {
    cuda.upload(data, [data.len()]).unwrap()
}

/// Upload f32 values stored as `dtype`.
fn up_as(cuda: &Cuda, dtype: DType, x: &[f32]) -> CudaTensor {
    match dtype {
        DType::F32 => up(cuda, x),
        DType::BF16 => up(
            cuda,
            &x.iter().map(|&v| bf16::from_f32(v)).collect::<Vec<_>>(),
        ),
        DType::F16 => up(
            cuda,
            &x.iter().map(|&v| f16::from_f32(v)).collect::<Vec<_>>(),
        ),
        other => unreachable!("{other}"),
    }
}

/// Download any float tensor as f32 values.
fn down(cuda: &Cuda, t: &CudaTensor) -> Vec<f32> {
    use headroom_tensor::Tensor;
    match t.dtype() {
        DType::F32 => cuda.download::<f32>(t).unwrap(),
        DType::BF16 => cuda
            .download::<bf16>(t)
            .unwrap()
            .iter()
            .map(|v| v.to_f32())
            .collect(),
        DType::F16 => cuda
            .download::<f16>(t)
            .unwrap()
            .iter()
            .map(|v| v.to_f32())
            .collect(),
        other => unreachable!("{other}"),
    }
}

// ------------------------------------------------------------------------------------------
// The references against the crates they transcribe (no GPU needed).

include!("golden/trainer_ops.rs");

#[test]
fn bitwise_references_match_the_crates_they_transcribe() {
    let x = golden_inputs();
    let fwd: Vec<u32> = x.iter().map(|&v| ref_gelu(v).to_bits()).collect();
    assert_eq!(fwd, GOLDEN_GELU_FORWARD, "GELU forward vs headroom-trainer");
    let dout: Vec<f32> = (0..x.len()).map(|i| 0.25 + (i as f32) * 0.125).collect();
    let bwd: Vec<u32> = (0..x.len())
        .map(|i| ref_gelu_backward((i as f32) * -0.01, x[i], dout[i]).to_bits())
        .collect();
    assert_eq!(
        bwd, GOLDEN_GELU_BACKWARD,
        "GELU backward vs headroom-trainer"
    );

    let key = StochasticRoundingKey {
        seed: 0x1234_5678_9abc_def0,
        step: 77,
        tensor: 5,
    };
    let random: Vec<u16> = GOLDEN_SR_INDICES
        .iter()
        .map(|&i| ref_random_bits(key, i))
        .collect();
    assert_eq!(random, GOLDEN_SR_BITS, "random bits vs headroom-amp");
    let rounded: Vec<u16> = x
        .iter()
        .enumerate()
        .map(|(i, &v)| ref_stochastic_round(v, ref_random_bits(key, i as u64)))
        .collect();
    assert_eq!(rounded, GOLDEN_SR_ROUNDED, "roundings vs headroom-amp");

    let s = AdamWStep::new(3e-4, 0.9, 0.95, 1e-8, 0.1, 7);
    // headroom-offload's StepScalars::new printed these for the same arguments.
    let offload = AdamWStep {
        decay: 0.99997,
        one_minus_beta1: 0.1,
        beta2: 0.95,
        one_minus_beta2: 0.05,
        step_size: 0.000_575_039_7,
        bc2_sqrt: 0.549_238_26,
        eps: 1e-8,
    };
    assert_eq!(s, offload, "step constants vs headroom-offload");
    let mut p: Vec<f32> = x.iter().map(|v| v * 0.1).collect();
    let g: Vec<f32> = dout.iter().zip(&x).map(|(a, b)| a * b * 0.01).collect();
    let mut m: Vec<f32> = x.iter().map(|v| v * 1e-3).collect();
    let mut v: Vec<f32> = x.iter().map(|v| v * v * 1e-4).collect();
    ref_adamw(&s, &mut p, &g, &mut m, &mut v);
    assert_eq!(
        bits(&p),
        GOLDEN_ADAMW_PARAM,
        "AdamW params vs headroom-offload"
    );
    assert_eq!(bits(&m), GOLDEN_ADAMW_M, "AdamW m vs headroom-offload");
    assert_eq!(bits(&v), GOLDEN_ADAMW_V, "AdamW v vs headroom-offload");

    // 1 - β1 ≥ 0.5: ATen's other lerp formula.
    let s = AdamWStep::new(3e-4, 0.3, 0.95, 1e-8, 0.1, 7);
    assert_eq!(s.one_minus_beta1, 0.7);
    assert_eq!(
        s.step_size, 0.000_300_065_6,
        "step size vs headroom-offload"
    );
    let mut p: Vec<f32> = x.iter().map(|v| v * 0.1).collect();
    let mut m: Vec<f32> = x.iter().map(|v| v * 1e-3).collect();
    let mut v: Vec<f32> = x.iter().map(|v| v * v * 1e-4).collect();
    ref_adamw(&s, &mut p, &g, &mut m, &mut v);
    assert_eq!(
        bits(&p),
        GOLDEN_ADAMW_LARGE_WEIGHT_PARAM,
        "AdamW params (β1 0.3) vs headroom-offload"
    );
    assert_eq!(
        bits(&m),
        GOLDEN_ADAMW_LARGE_WEIGHT_M,
        "AdamW m (β1 0.3) vs headroom-offload"
    );
    assert_eq!(
        bits(&v),
        GOLDEN_ADAMW_V,
        "AdamW v (β1 0.3) vs headroom-offload"
    );
}

#[test]
fn the_gemm_reference_is_the_definition() {
    // [[1, 2], [3, 4]]·[[5, 6], [7, 8]]ᵀ = [[17, 23], [39, 53]]; Σ|terms| for the bound.
    let s = GemmShape { m: 2, n: 2, k: 2 };
    let got = ref_gemm(
        GemmOp::Forward,
        s,
        &[1.0, 2.0, 3.0, 4.0],
        &[5.0, 6.0, 7.0, 8.0],
    );
    assert_eq!(
        got,
        vec![(17.0, 17.0), (23.0, 23.0), (39.0, 39.0), (53.0, 53.0)]
    );
    // dX = dY·W and dW = dYᵀ·X on the same numbers.
    let dx = ref_gemm(
        GemmOp::InputGrad,
        s,
        &[1.0, 2.0, 3.0, 4.0],
        &[5.0, 6.0, 7.0, 8.0],
    );
    assert_eq!(
        dx.iter().map(|e| e.0).collect::<Vec<_>>(),
        vec![19.0, 22.0, 43.0, 50.0]
    );
    let dw = ref_gemm(
        GemmOp::WeightGrad,
        s,
        &[1.0, 2.0, 3.0, -4.0],
        &[5.0, 6.0, 7.0, 8.0],
    );
    assert_eq!(
        dw.iter().map(|e| e.0).collect::<Vec<_>>(),
        vec![26.0, 30.0, -18.0, -20.0]
    );
    assert_eq!(dw[3].1, 44.0);
}

// ------------------------------------------------------------------------------------------
// GPU parity tests.

/// Run the op twice on fresh copies of its outputs; the two results must be bitwise equal.
fn assert_deterministic(what: &str, first: &[f32], second: &[f32]) {
    assert_eq!(bits(first), bits(second), "{what}: two runs differ");
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_gemm_matches_the_definition_for_every_product_and_dtype() {
    let cuda = cuda();
    let shapes = [
        GemmShape { m: 1, n: 1, k: 1 },
        GemmShape {
            m: 37,
            n: 19,
            k: 53,
        },
        GemmShape {
            m: 256,
            n: 768,
            k: 64,
        },
        GemmShape {
            m: 64,
            n: 96,
            k: 768,
        },
    ];
    for s in shapes {
        for in_dtype in [DType::F32, DType::BF16, DType::F16] {
            for out_dtype in [DType::F32, in_dtype] {
                for op in [GemmOp::Forward, GemmOp::InputGrad, GemmOp::WeightGrad] {
                    let GemmShape { m, n, k } = s;
                    let (a_len, b_len, out_len, inner) = match op {
                        GemmOp::Forward => (m * k, n * k, m * n, k),
                        GemmOp::InputGrad => (m * n, n * k, m * k, n),
                        GemmOp::WeightGrad => (m * n, m * k, n * k, m),
                    };
                    let out_cols = match op {
                        GemmOp::Forward => n,
                        _ => k,
                    };
                    let a = round_to(in_dtype, &values(a_len, 1, 1.0));
                    let b = round_to(in_dtype, &values(b_len, 2, 1.0));
                    let c0 = round_to(out_dtype, &values(out_len, 3, 1.0));
                    let bias = round_to(out_dtype, &values(out_cols, 4, 1.0));
                    let exact = ref_gemm(op, s, &a, &b);
                    let (ta, tb) = (up_as(&cuda, in_dtype, &a), up_as(&cuda, in_dtype, &b));
                    let tbias = up_as(&cuda, out_dtype, &bias);
                    for (accumulate, with_bias) in
                        [(false, false), (true, false), (false, true), (true, true)]
                    {
                        let mut out = up_as(&cuda, out_dtype, &c0);
                        cuda.gemm(
                            op,
                            s,
                            &mut out,
                            &ta,
                            &tb,
                            with_bias.then_some(&tbias),
                            accumulate,
                        )
                        .unwrap();
                        let got = down(&cuda, &out);
                        // γ_k·Σ|a·b| covers any f32 summation order; one more rounding for the
                        // output (2⁻⁸ for bf16, 2⁻¹¹ for f16, 2⁻²⁴ for f32) and for the adds of
                        // C and the bias.
                        let gamma = inner as f64 * f32::EPSILON as f64;
                        let out_eps = match out_dtype {
                            DType::BF16 => 1.0 / 256.0,
                            DType::F16 => 1.0 / 2048.0,
                            _ => f32::EPSILON as f64,
                        };
                        for i in 0..out_len {
                            let (sum, mag) = exact[i];
                            let extra = (if accumulate { c0[i] as f64 } else { 0.0 })
                                + (if with_bias {
                                    bias[i % out_cols] as f64
                                } else {
                                    0.0
                                });
                            let want = sum + extra;
                            let allowed = gamma * mag
                                + out_eps * (want.abs() + mag + extra.abs())
                                + 4.0 * f32::EPSILON as f64 * extra.abs();
                            let err = (got[i] as f64 - want).abs();
                            assert!(
                                err <= allowed,
                                "{op:?} {s:?} {in_dtype}->{out_dtype} acc={accumulate} \
                                 bias={with_bias} [{i}]: got {}, want {want} (allowed {allowed:e})",
                                got[i]
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_matmul_backward_accumulates_and_its_bias_gradient_is_deterministic() {
    let cuda = cuda();
    let (n, c, oc) = (300, 48, 40);
    let inp = values(n * c, 5, 1.0);
    let w = values(oc * c, 6, 0.5);
    let dout = values(n * oc, 7, 1.0);
    let (ti, tw, td) = (up(&cuda, &inp), up(&cuda, &w), up(&cuda, &dout));
    let run = || {
        let mut dinp = up(&cuda, &vec![1.0f32; n * c]);
        let mut dw = up(&cuda, &vec![-1.0f32; oc * c]);
        let mut db = up(&cuda, &vec![0.5f32; oc]);
        cuda.matmul_backward(&mut dinp, &mut dw, Some(&mut db), &td, &ti, &tw, n, c, oc)
            .unwrap();
        (down(&cuda, &dinp), down(&cuda, &dw), down(&cuda, &db))
    };
    let (dinp, dw, db) = run();
    let s = GemmShape { m: n, n: oc, k: c };
    let want_dinp: Vec<f64> = ref_gemm(GemmOp::InputGrad, s, &dout, &w)
        .iter()
        .map(|e| e.0 + 1.0)
        .collect();
    let want_dw: Vec<f64> = ref_gemm(GemmOp::WeightGrad, s, &dout, &inp)
        .iter()
        .map(|e| e.0 - 1.0)
        .collect();
    let want_db: Vec<f64> = (0..oc)
        .map(|j| 0.5 + (0..n).map(|r| dout[r * oc + j] as f64).sum::<f64>())
        .collect();
    // Inputs in [-1, 1]: Σ|terms| ≤ inner, so γ·inner² bounds the error; 1e-4 absolute covers it.
    assert_close("dinp", &dinp, &want_dinp, 1e-6, 1e-4);
    assert_close("dweight", &dw, &want_dw, 1e-6, 1e-3);
    assert_close("dbias", &db, &want_db, 1e-6, 1e-4);
    let (dinp2, dw2, db2) = run();
    assert_deterministic("dbias", &db, &db2);
    assert_deterministic("dinp", &dinp, &dinp2);
    assert_deterministic("dweight", &dw, &dw2);
    // And the forward with bias through the trainer-shaped entry point.
    let b = values(oc, 8, 1.0);
    let mut out = cuda.zeros([n * oc], DType::F32).unwrap();
    cuda.matmul_forward(&mut out, &ti, &tw, Some(&up(&cuda, &b)), n, c, oc)
        .unwrap();
    let want: Vec<f64> = ref_gemm(GemmOp::Forward, s, &inp, &w)
        .iter()
        .enumerate()
        .map(|(i, e)| e.0 + b[i % oc] as f64)
        .collect();
    assert_close("forward", &down(&cuda, &out), &want, 1e-6, 1e-4);
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_embedding_is_bitwise_equal_to_the_cpu_op() {
    let cuda = cuda();
    for (b, t, c, vocab) in [
        (1, 1, 1, 1),
        (2, 5, 3, 7),
        (4, 64, 96, 1000),
        (3, 17, 300, 50_257),
    ] {
        // Repeated tokens (the scatter's hard case), every position used.
        let mut tokens: Vec<u32> = (0..b * t)
            .map(|i| ((i * i * 7 + 3) % vocab.min(11)) as u32)
            .collect();
        // Tokens on both sides of the scatter's vocabulary-block boundaries (512 rows each).
        for (slot, tok) in tokens.iter_mut().zip([0, 511, 512, 1023, 1024, vocab - 1]) {
            *slot = tok.min(vocab - 1) as u32;
        }
        let wte = values(vocab * c, 9, 1.0);
        let wpe = values((t + 2) * c, 10, 1.0); // max_t > t is allowed
        let (tt, twte, twpe) = (up(&cuda, &tokens), up(&cuda, &wte), up(&cuda, &wpe));
        let mut out = cuda.zeros([b * t * c], DType::F32).unwrap();
        cuda.embedding_forward(&mut out, &tt, &twte, &twpe, t, c)
            .unwrap();
        assert_bitwise(
            "embedding forward",
            &down(&cuda, &out),
            &ref_embedding_forward(&tokens, &wte, &wpe, t, c),
        );

        let dout = values(b * t * c, 11, 1.0);
        let dwte0 = values(vocab * c, 12, 0.1);
        let dwpe0 = values((t + 2) * c, 13, 0.1);
        let (mut want_wte, mut want_wpe) = (dwte0.clone(), dwpe0.clone());
        ref_embedding_backward(&mut want_wte, &mut want_wpe, &dout, &tokens, t, c);
        let mut first = None;
        for _ in 0..2 {
            let (mut dwte, mut dwpe) = (up(&cuda, &dwte0), up(&cuda, &dwpe0));
            cuda.embedding_backward(&mut dwte, &mut dwpe, &up(&cuda, &dout), &tt, t, c)
                .unwrap();
            let got = (down(&cuda, &dwte), down(&cuda, &dwpe));
            assert_bitwise("dwte", &got.0, &want_wte);
            assert_bitwise("dwpe", &got.1, &want_wpe);
            if let Some(prev) = first.replace(got.clone()) {
                assert_eq!(prev, got);
            }
        }
    }
    // A token outside the vocabulary: a NaN row forward, skipped backward, no fault.
    let (t, c, vocab) = (2, 4, 3);
    let tokens = [1u32, 99];
    let wte = values(vocab * c, 14, 1.0);
    let wpe = values(t * c, 15, 1.0);
    let mut out = cuda.zeros([t * c], DType::F32).unwrap();
    cuda.embedding_forward(
        &mut out,
        &up(&cuda, &tokens),
        &up(&cuda, &wte),
        &up(&cuda, &wpe),
        t,
        c,
    )
    .unwrap();
    let got = down(&cuda, &out);
    assert!(got[..c].iter().all(|v| v.is_finite()) && got[c..].iter().all(|v| v.is_nan()));
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_layernorm_matches_the_reference_and_is_deterministic() {
    let cuda = cuda();
    for (rows, c) in [(1, 1), (3, 7), (64, 768), (257, 1600), (4096, 64)] {
        let inp: Vec<f32> = values(rows * c, 16, 2.0).iter().map(|v| v + 0.5).collect();
        let w: Vec<f32> = values(c, 17, 0.5).iter().map(|v| 1.0 + v).collect();
        let b = values(c, 18, 0.5);
        let (ti, tw, tb) = (up(&cuda, &inp), up(&cuda, &w), up(&cuda, &b));
        let forward = || {
            let mut out = cuda.zeros([rows * c], DType::F32).unwrap();
            let mut mean = cuda.zeros([rows], DType::F32).unwrap();
            let mut rstd = cuda.zeros([rows], DType::F32).unwrap();
            cuda.layernorm_forward(&mut out, &mut mean, &mut rstd, &ti, &tw, &tb, c)
                .unwrap();
            (down(&cuda, &out), down(&cuda, &mean), down(&cuda, &rstd))
        };
        let (out, mean, rstd) = forward();
        let (want_out, want_mean, want_rstd) = ref_layernorm(&inp, &w, &b, c);
        // f32 block-tree sums of O(1) values over c ≤ 1600 terms: relative 1e-5 with a 1e-5
        // floor for outputs near zero.
        assert_close("mean", &mean, &want_mean, 1e-5, 1e-6);
        assert_close("rstd", &rstd, &want_rstd, 1e-5, 1e-6);
        assert_close("out", &out, &want_out, 1e-5, 1e-5);
        let again = forward();
        assert_deterministic("layernorm out", &out, &again.0);

        let dout = values(rows * c, 19, 1.0);
        let (di0, dw0, db0) = (
            values(rows * c, 20, 0.1),
            values(c, 21, 0.1),
            values(c, 22, 0.1),
        );
        let backward = || {
            let (mut di, mut dw, mut db) = (up(&cuda, &di0), up(&cuda, &dw0), up(&cuda, &db0));
            let (tm, tr) = (up(&cuda, &mean), up(&cuda, &rstd));
            cuda.layernorm_backward(
                &mut di,
                &mut dw,
                &mut db,
                &up(&cuda, &dout),
                &ti,
                &tw,
                &tm,
                &tr,
                c,
            )
            .unwrap();
            (down(&cuda, &di), down(&cuda, &dw), down(&cuda, &db))
        };
        let (di, dw, db) = backward();
        let (want_di, want_dw, want_db) =
            ref_layernorm_backward(&di0, &dw0, &db0, &dout, &inp, &w, &mean, &rstd, c);
        assert_close("dinp", &di, &want_di, 1e-4, 1e-5);
        // Column sums over `rows` terms of O(1): absolute error grows like rows·eps.
        let col_abs = 1e-6 * rows as f64 + 1e-5;
        assert_close("dweight", &dw, &want_dw, 1e-5, col_abs);
        assert_close("dbias", &db, &want_db, 1e-5, col_abs);
        let again = backward();
        assert_deterministic("dinp", &di, &again.0);
        assert_deterministic("dweight", &dw, &again.1);
        assert_deterministic("dbias", &db, &again.2);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_gelu_and_residual_are_bitwise_equal_to_the_cpu_ops() {
    let cuda = cuda();
    let mut x = golden_inputs();
    x.extend(values(1 << 20, 23, 12.0));
    x.extend([
        f32::NAN,
        f32::INFINITY,
        f32::NEG_INFINITY,
        1e-40,
        -1e-40,
        88.0,
        -88.0,
    ]);
    let n = x.len();
    let tx = up(&cuda, &x);
    let mut out = cuda.zeros([n], DType::F32).unwrap();
    cuda.gelu_forward(&mut out, &tx).unwrap();
    let want: Vec<f32> = x.iter().map(|&v| ref_gelu(v)).collect();
    assert_bitwise("gelu forward", &down(&cuda, &out), &want);

    let dout = values(n, 24, 1.0);
    let di0 = values(n, 25, 0.5);
    let mut di = up(&cuda, &di0);
    cuda.gelu_backward(&mut di, &tx, &up(&cuda, &dout)).unwrap();
    let want: Vec<f32> = (0..n)
        .map(|i| ref_gelu_backward(di0[i], x[i], dout[i]))
        .collect();
    assert_bitwise("gelu backward", &down(&cuda, &di), &want);

    let mut y = up(&cuda, &di0);
    cuda.residual_add(&mut y, &up(&cuda, &dout)).unwrap();
    let want: Vec<f32> = di0.iter().zip(&dout).map(|(a, b)| a + b).collect();
    assert_bitwise("residual", &down(&cuda, &y), &want);
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_cross_entropy_matches_the_reference() {
    let cuda = cuda();
    for (rows, v) in [(1, 1), (3, 7), (17, 1000), (64, 50_257)] {
        let logits = values(rows * v, 26, 8.0);
        let targets: Vec<u32> = (0..rows).map(|r| ((r * 7919) % v) as u32).collect();
        let dloss: Vec<f32> = (0..rows)
            .map(|r| 1.0 / rows as f32 + r as f32 * 1e-3)
            .collect();
        let (tl, tt, td) = (up(&cuda, &logits), up(&cuda, &targets), up(&cuda, &dloss));
        let (want_loss, want_grad) = ref_cross_entropy(&logits, &targets, &dloss, v);
        let run = || {
            let mut losses = cuda.zeros([rows], DType::F32).unwrap();
            let mut dlogits = up(&cuda, &vec![f32::NAN; rows * v]); // overwritten
            cuda.cross_entropy_forward_backward(&mut losses, &mut dlogits, &tl, &tt, &td, v)
                .unwrap();
            (down(&cuda, &losses), down(&cuda, &dlogits))
        };
        let (losses, grads) = run();
        // exp within a few ulp, logf within 1 ulp, f32 sums of v ≤ 50k terms ≤ 1.
        assert_close("loss", &losses, &want_loss, 1e-5, 1e-5);
        assert_close("dlogits", &grads, &want_grad, 1e-4, 1e-7);
        let again = run();
        assert_deterministic("loss", &losses, &again.0);
        assert_deterministic("dlogits", &grads, &again.1);
        let mut only = cuda.zeros([rows], DType::F32).unwrap();
        cuda.cross_entropy_forward(&mut only, &tl, &tt, v).unwrap();
        assert_deterministic("forward-only loss", &losses, &down(&cuda, &only));
        let mut g = cuda.zeros([rows * v], DType::F32).unwrap();
        cuda.cross_entropy_backward(&mut g, &tl, &tt, &td, v)
            .unwrap();
        assert_deterministic("backward-only dlogits", &grads, &down(&cuda, &g));
        let (mut in_place_losses, mut in_place) =
            (cuda.zeros([rows], DType::F32).unwrap(), up(&cuda, &logits));
        cuda.cross_entropy_forward_backward_in_place(
            &mut in_place_losses,
            &mut in_place,
            &tt,
            &td,
            v,
        )
        .unwrap();
        assert_deterministic("in-place loss", &losses, &down(&cuda, &in_place_losses));
        assert_deterministic("in-place dlogits", &grads, &down(&cuda, &in_place));
    }
}

/// bf16 logits (the trainer's head under bf16): the f32 entries' losses bit for bit, and the
/// bf16 rounding of their gradients, written over the logits.
#[test]
#[ignore = "needs a CUDA device"]
fn cuda_bf16_cross_entropy_is_the_f32_one_rounded() {
    let cuda = cuda();
    for (rows, v) in [(1, 1), (3, 7), (17, 1000), (64, 50_257)] {
        let bits: Vec<u16> = values(rows * v, 26, 8.0)
            .iter()
            .map(|&x| bf16::from_f32(x).to_bits())
            .collect();
        let widened: Vec<f32> = bits.iter().map(|&b| bf16::from_bits(b).to_f32()).collect();
        let targets: Vec<u32> = (0..rows).map(|r| ((r * 7919) % v) as u32).collect();
        let dloss: Vec<f32> = (0..rows).map(|r| 0.5 + r as f32 * 1e-3).collect();
        let (tt, td) = (up(&cuda, &targets), up(&cuda, &dloss));
        let (mut l32, mut g32) = (cuda.zeros([rows], DType::F32).unwrap(), up(&cuda, &widened));
        cuda.cross_entropy_forward_backward_in_place(&mut l32, &mut g32, &tt, &td, v)
            .unwrap();
        let mut l16 = cuda.zeros([rows], DType::F32).unwrap();
        let mut g16 = up_as(&cuda, DType::BF16, &widened);
        cuda.cross_entropy_forward_backward_in_place(&mut l16, &mut g16, &tt, &td, v)
            .unwrap();
        let losses = down(&cuda, &l32);
        assert_bitwise("bf16 in-place loss", &down(&cuda, &l16), &losses);
        let want: Vec<u16> = down(&cuda, &g32)
            .iter()
            .map(|&g| bf16::from_f32(g).to_bits())
            .collect();
        let got: Vec<u16> = cuda
            .download::<bf16>(&g16)
            .unwrap()
            .iter()
            .map(|g| g.to_bits())
            .collect();
        assert_eq!(got, want, "bf16 gradient bits");
        let mut only = cuda.zeros([rows], DType::F32).unwrap();
        let logits16 = up_as(&cuda, DType::BF16, &widened);
        cuda.cross_entropy_forward(&mut only, &logits16, &tt, v)
            .unwrap();
        assert_bitwise("bf16 forward-only loss", &down(&cuda, &only), &losses);
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_adamw_is_bitwise_equal_to_the_offload_reference() {
    let cuda = cuda();
    let n = (1 << 20) + 37;
    let p0 = values(n, 27, 1.0);
    let g32 = values(n, 28, 0.1);
    let m0 = values(n, 29, 0.01);
    let v0: Vec<f32> = values(n, 30, 0.01).iter().map(|v| v * v).collect();
    for (beta1, step) in [(0.9, 1), (0.9, 2), (0.9, 1000), (0.3, 2)] {
        let s = AdamWStep::new(6e-4, beta1, 0.95, 1e-8, 0.1, step);
        for grad_dtype in [DType::F32, DType::BF16] {
            let g = round_to(grad_dtype, &g32);
            let (mut wp, mut wm, mut wv) = (p0.clone(), m0.clone(), v0.clone());
            ref_adamw(&s, &mut wp, &g, &mut wm, &mut wv);
            for with_copy in [false, true] {
                let (mut p, mut m, mut v) = (up(&cuda, &p0), up(&cuda, &m0), up(&cuda, &v0));
                let mut copy = cuda.zeros([n], DType::BF16).unwrap();
                let tg = up_as(&cuda, grad_dtype, &g);
                cuda.adamw_step(
                    &s,
                    &mut p,
                    &tg,
                    &mut m,
                    &mut v,
                    with_copy.then_some(&mut copy),
                )
                .unwrap();
                assert_bitwise("param", &down(&cuda, &p), &wp);
                assert_bitwise("m", &down(&cuda, &m), &wm);
                assert_bitwise("v", &down(&cuda, &v), &wv);
                if with_copy {
                    let got: Vec<u16> = cuda
                        .download::<bf16>(&copy)
                        .unwrap()
                        .iter()
                        .map(|b| b.to_bits())
                        .collect();
                    let want: Vec<u16> = wp.iter().map(|&x| bf16::from_f32(x).to_bits()).collect();
                    assert_eq!(got, want, "bf16 copy");
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_stochastic_rounding_is_bitwise_equal_to_amp() {
    let cuda = cuda();
    let mut x = golden_inputs();
    x.extend(values((1 << 20) + 5, 31, 1e4));
    x.extend([
        f32::NAN,
        -f32::NAN,
        f32::from_bits(0x7f80_0001),
        f32::INFINITY,
        f32::MAX,
        -f32::MAX,
        1e-40,
    ]);
    let key = StochasticRoundingKey {
        seed: 42,
        step: 9,
        tensor: 3,
    };
    let mut dst = cuda.zeros([x.len()], DType::BF16).unwrap();
    cuda.stochastic_round_bf16(&up(&cuda, &x), &mut dst, key)
        .unwrap();
    let got: Vec<u16> = cuda
        .download::<bf16>(&dst)
        .unwrap()
        .iter()
        .map(|b| b.to_bits())
        .collect();
    let want: Vec<u16> = x
        .iter()
        .enumerate()
        .map(|(i, &v)| ref_stochastic_round(v, ref_random_bits(key, i as u64)))
        .collect();
    assert_eq!(got, want);
}

/// Records every allocation event.
#[derive(Default)]
struct Recorder(Mutex<Vec<(bool, AllocEvent)>>);

impl AllocHook for Recorder {
    fn on_alloc(&self, event: &AllocEvent) -> Result<(), BoxedError> {
        self.0.lock().unwrap().push((true, *event));
        Ok(())
    }
    fn on_free(&self, event: &AllocEvent) {
        self.0.lock().unwrap().push((false, *event));
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_gemm_and_op_scratch_memory_is_reported_as_workspace() {
    let recorder = Arc::new(Recorder::default());
    let cuda = cuda().with_alloc_hook(recorder.clone());
    let (m, n, k) = (32, 16, 8);
    let (a, b) = (
        up(&cuda, &values(m * k, 1, 1.0)),
        up(&cuda, &values(n * k, 2, 1.0)),
    );
    let mut out = cuda.zeros([m * n], DType::F32).unwrap();
    recorder.0.lock().unwrap().clear();
    cuda.gemm(
        GemmOp::Forward,
        GemmShape { m, n, k },
        &mut out,
        &a,
        &b,
        None,
        false,
    )
    .unwrap();
    cuda.synchronize().unwrap();
    let events = recorder.0.lock().unwrap().clone();
    let ws: Vec<_> = events
        .iter()
        .filter(|(_, e)| e.category == MemoryCategory::Workspace)
        .collect();
    assert_eq!(
        ws.len(),
        2,
        "one workspace allocation and its free: {events:?}"
    );
    assert!(ws[0].0 && !ws[1].0);
    assert!(ws[0].1.bytes >= 4 << 20);
    // Layer norm backward's partials are workspace too, and balanced.
    recorder.0.lock().unwrap().clear();
    let (rows, c) = (40, 24);
    let x = up(&cuda, &values(rows * c, 3, 1.0));
    let w = up(&cuda, &vec![1.0f32; c]);
    let stats = up(&cuda, &vec![0.5f32; rows]);
    let (mut di, mut dw, mut db) = (
        cuda.zeros([rows * c], DType::F32).unwrap(),
        cuda.zeros([c], DType::F32).unwrap(),
        cuda.zeros([c], DType::F32).unwrap(),
    );
    recorder.0.lock().unwrap().clear();
    cuda.layernorm_backward(&mut di, &mut dw, &mut db, &x, &x, &w, &stats, &stats, c)
        .unwrap();
    let events = recorder.0.lock().unwrap().clone();
    let allocs = events
        .iter()
        .filter(|(a, e)| *a && e.category == MemoryCategory::Workspace)
        .count();
    let frees = events
        .iter()
        .filter(|(a, e)| !*a && e.category == MemoryCategory::Workspace)
        .count();
    assert_eq!((allocs, frees), (2, 2), "{events:?}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_ops_refuse_bad_arguments_before_touching_anything() {
    let cuda = cuda();
    let x = up(&cuda, &values(12, 1, 1.0));
    let mut out = up(&cuda, &[7.0f32; 12]);
    // GELU with a length mismatch, residual with a dtype mismatch.
    let short = up(&cuda, &values(11, 2, 1.0));
    assert!(matches!(
        cuda.gelu_forward(&mut out, &short),
        Err(Error::LengthMismatch { .. })
    ));
    let half = cuda.zeros([12], DType::BF16).unwrap();
    assert!(matches!(
        cuda.residual_add(&mut out, &half),
        Err(Error::DTypeMismatch { .. })
    ));
    // Layer norm with c not dividing the input.
    let (mut m, mut r) = (
        cuda.zeros([2], DType::F32).unwrap(),
        cuda.zeros([2], DType::F32).unwrap(),
    );
    let w = up(&cuda, &[1.0f32; 5]);
    assert!(matches!(
        cuda.layernorm_forward(&mut out, &mut m, &mut r, &x, &w, &w, 5),
        Err(Error::InvalidShape { .. })
    ));
    // GEMM with mixed input dtypes.
    let mut o = cuda.zeros([4], DType::F32).unwrap();
    let s = GemmShape { m: 2, n: 2, k: 3 };
    let a = up(&cuda, &values(6, 3, 1.0));
    let b = cuda.zeros([6], DType::BF16).unwrap();
    assert!(matches!(
        cuda.gemm(GemmOp::Forward, s, &mut o, &a, &b, None, false),
        Err(Error::DTypeMismatch { .. })
    ));
    // AdamW with f16 gradients (unsupported) and a copy of the wrong dtype.
    let (mut p, mut mm, mut vv) = (
        up(&cuda, &[1.0f32; 4]),
        up(&cuda, &[0.0f32; 4]),
        up(&cuda, &[0.0f32; 4]),
    );
    let g16 = cuda.zeros([4], DType::F16).unwrap();
    let step = AdamWStep::new(1e-3, 0.9, 0.999, 1e-8, 0.0, 1);
    assert!(matches!(
        cuda.adamw_step(&step, &mut p, &g16, &mut mm, &mut vv, None),
        Err(Error::UnsupportedDType { .. })
    ));
    let g = up(&cuda, &[1.0f32; 4]);
    let mut bad_copy = cuda.zeros([4], DType::F32).unwrap();
    assert!(matches!(
        cuda.adamw_step(&step, &mut p, &g, &mut mm, &mut vv, Some(&mut bad_copy)),
        Err(Error::DTypeMismatch { .. })
    ));
    // Nothing was written.
    assert_eq!(down(&cuda, &out), vec![7.0f32; 12]);
    assert_eq!(down(&cuda, &p), vec![1.0f32; 4]);
}

/// Every part split out of `wide` and merged back, on the device, against the CPU loops:
/// bitwise, and a merge of one part leaves the other parts' bytes alone.
fn check_head_permutes<T>(cuda: &Cuda, layout: HeadLayout, wide: &[T], sentinel: T)
where
    T: Element + Copy + PartialEq + std::fmt::Debug,
{
    let (b, t, nh, hs, parts) = (
        layout.batch,
        layout.seq,
        layout.heads,
        layout.head_dim,
        layout.parts,
    );
    let c = nh * hs;
    let what = format!("{layout:?} {}", T::DTYPE);
    let twide = cuda.upload(wide, [b, t, parts * c]).unwrap();
    let mut merged = cuda
        .upload(&vec![sentinel; wide.len()], [b, t, parts * c])
        .unwrap();
    for part in 0..parts {
        let l = layout.part_of(parts, part);
        let mut heads = cuda
            .upload(&vec![sentinel; b * c * t], [b, nh, t, hs])
            .unwrap();
        cuda.split_heads(&mut heads, &twide, l).unwrap();
        let got = cuda.download::<T>(&heads).unwrap();
        assert!(got == ref_split_heads(wide, l), "split part {part}: {what}");
        // One part merged alone into a sentinel buffer: only that part changes.
        let mut one = cuda
            .upload(&vec![sentinel; wide.len()], [b, t, parts * c])
            .unwrap();
        cuda.merge_heads(&mut one, &heads, l).unwrap();
        let mut want = vec![sentinel; wide.len()];
        ref_merge_heads(&mut want, &got, l);
        assert!(
            cuda.download::<T>(&one).unwrap() == want,
            "merge part {part}: {what}"
        );
        cuda.merge_heads(&mut merged, &heads, l).unwrap();
    }
    assert!(
        cuda.download::<T>(&merged).unwrap() == wide,
        "every part merged back: {what}"
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_head_permutes_are_the_cpu_permutation() {
    let cuda = cuda();
    let bits16 = |n: usize, seed: u32| -> Vec<u16> {
        values(n, seed, 4.0)
            .iter()
            .map(|&v| bf16::from_f32(v).to_bits())
            .collect()
    };
    let sentinel16 = bf16::from_f32(-1234.0).to_bits();
    // GPT-2 124M's qkv at T = 1024 (16-byte units, a grid at its cap: rows stride), then odd
    // T, more heads than positions, T = 1, and head rows of 6, 148 bytes (2- and 4-byte units).
    for (i, (b, t, nh, hs, parts)) in [
        (4, 1024, 12, 64, 3),
        (2, 7, 12, 64, 3),
        (1, 3, 5, 128, 1),
        (3, 1, 4, 8, 3),
        (2, 5, 3, 3, 3),
        (2, 2, 6, 74, 1),
    ]
    .into_iter()
    .enumerate()
    {
        let layout = HeadLayout::single(b, t, nh, hs).part_of(parts, 0);
        let wide = bits16(layout.wide_numel().unwrap(), 40 + i as u32);
        check_head_permutes(&cuda, layout, &wide, sentinel16);
        // The same layout in bf16 proper, the trainer's dtype.
        let wide16: Vec<bf16> = wide.iter().map(|&x| bf16::from_bits(x)).collect();
        check_head_permutes(&cuda, layout, &wide16, bf16::from_bits(sentinel16));
    }
    // Other element sizes: f32 with 20-byte head rows, u8 with 7-byte rows, i64.
    let l = HeadLayout::single(2, 3, 2, 5).part_of(3, 0);
    check_head_permutes(&cuda, l, &values(l.wide_numel().unwrap(), 50, 1.0), -7.0f32);
    let l = HeadLayout::single(2, 3, 3, 7).part_of(2, 0);
    let bytes: Vec<u8> = (0..l.wide_numel().unwrap())
        .map(|i| (i % 251) as u8)
        .collect();
    check_head_permutes(&cuda, l, &bytes, 255u8);
    let l = HeadLayout::single(1, 5, 3, 2).part_of(3, 0);
    let longs: Vec<i64> = (0..l.wide_numel().unwrap() as i64).collect();
    check_head_permutes(&cuda, l, &longs, -1i64);
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_head_permutes_refuse_bad_arguments_before_touching_anything() {
    let cuda = cuda();
    let l = HeadLayout::single(2, 3, 2, 4).part_of(3, 0);
    let wide = cuda.upload(&[1u16; 2 * 3 * 3 * 8], [2, 3, 24]).unwrap();
    let mut heads = cuda.upload(&[7u16; 2 * 2 * 3 * 4], [2, 2, 3, 4]).unwrap();
    // Part out of range.
    assert!(matches!(
        cuda.split_heads(&mut heads, &wide, l.part_of(3, 3)),
        Err(Error::InvalidShape { .. })
    ));
    // Element counts that are not the layout's.
    assert!(matches!(
        cuda.split_heads(&mut heads, &wide, l.part_of(2, 0)),
        Err(Error::LengthMismatch { .. })
    ));
    // Mixed dtypes.
    let wide32 = cuda.zeros([2, 3, 24], DType::F32).unwrap();
    assert!(matches!(
        cuda.split_heads(&mut heads, &wide32, l),
        Err(Error::DTypeMismatch { .. })
    ));
    let mut wide_out = cuda.upload(&[9u16; 2 * 3 * 24], [2, 3, 24]).unwrap();
    let heads32 = cuda.zeros([2, 2, 3, 4], DType::F32).unwrap();
    assert!(matches!(
        cuda.merge_heads(&mut wide_out, &heads32, l),
        Err(Error::DTypeMismatch { .. })
    ));
    // Nothing was written.
    assert_eq!(cuda.download::<u16>(&heads).unwrap(), vec![7u16; 48]);
    assert_eq!(cuda.download::<u16>(&wide_out).unwrap(), vec![9u16; 144]);
}

// ------------------------------------------------------------------------------------------
// Llama's ops (token embedding, RMSNorm, SwiGLU, rotary embedding), the in-place rounding, the
// bias-gradient column sum and element-range copies.

#[test]
#[ignore = "needs a CUDA device"]
fn llama_ops_match_the_cpu_references() {
    use headroom_tensor::Tensor;
    let cuda = cuda();
    let twice = |f: &dyn Fn() -> Vec<f32>| {
        let (a, b) = (f(), f());
        assert_eq!(bits(&a), bits(&b), "not deterministic");
        a
    };
    let widen = |v: &[f32]| v.iter().map(|&x| x as f64).collect::<Vec<f64>>();

    // Token embedding and its scatter: bitwise.
    let (rows, c, vocab) = (13usize, 300usize, 1100usize);
    let tokens: Vec<u32> = (0..rows)
        .map(|i| ((i * i * 7 + 3) % vocab) as u32)
        .collect();
    let (wte, dout) = (values(vocab * c, 60, 1.0), values(rows * c, 61, 1.0));
    let dwte0 = values(vocab * c, 62, 0.1);
    let tk = up(&cuda, &tokens);
    let got = twice(&|| {
        let mut out = cuda.zeros([rows, c], DType::F32).unwrap();
        cuda.embedding_forward_tokens(&mut out, &tk, &up(&cuda, &wte), c)
            .unwrap();
        down(&cuda, &out)
    });
    let want: Vec<f32> = tokens
        .iter()
        .flat_map(|&t| wte[t as usize * c..][..c].to_vec())
        .collect();
    assert_bitwise("token embedding", &got, &want);
    let got = twice(&|| {
        let mut d = up(&cuda, &dwte0);
        cuda.embedding_backward_tokens(&mut d, &up(&cuda, &dout), &tk, c)
            .unwrap();
        down(&cuda, &d)
    });
    let mut want = dwte0.clone();
    for (d, &t) in dout.chunks_exact(c).zip(&tokens) {
        for j in 0..c {
            want[t as usize * c + j] += d[j];
        }
    }
    assert_bitwise("token embedding backward", &got, &want);

    // RMSNorm: f64 sums in another order, one ulp.
    let (rows, c, eps) = (37usize, 768usize, 1e-6f32);
    let x: Vec<f32> = values(rows * c, 63, 2.0).iter().map(|v| v + 0.25).collect();
    let w: Vec<f32> = values(c, 64, 0.5).iter().map(|v| 1.0 + v).collect();
    let (mut out, mut rstd) = (
        cuda.zeros([rows, c], DType::F32).unwrap(),
        cuda.zeros([rows], DType::F32).unwrap(),
    );
    let (xd, wd) = (up(&cuda, &x), up(&cuda, &w));
    cuda.rmsnorm_forward(&mut out, &mut rstd, &xd, &wd, c, eps)
        .unwrap();
    let (want_out, want_rstd) = ref_rmsnorm(&x, &w, eps, c);
    let r = down(&cuda, &rstd);
    assert_close("rmsnorm rstd", &r, &widen(&want_rstd), 2e-7, 0.0);
    assert_close(
        "rmsnorm out",
        &down(&cuda, &out),
        &widen(&want_out),
        4e-7,
        1e-7,
    );
    let dout = values(rows * c, 65, 1.0);
    let (di0, dw0) = (values(rows * c, 66, 0.1), values(c, 67, 0.1));
    let (mut di, mut dw) = (up(&cuda, &di0), up(&cuda, &dw0));
    cuda.rmsnorm_backward(&mut di, &mut dw, &up(&cuda, &dout), &xd, &wd, &rstd, c)
        .unwrap();
    let (mut want_di, mut want_dw) = (di0, dw0);
    ref_rmsnorm_backward(&mut want_di, &mut want_dw, &dout, &x, &w, &r, c);
    assert_close(
        "rmsnorm dinp",
        &down(&cuda, &di),
        &widen(&want_di),
        1e-5,
        1e-6,
    );
    assert_close(
        "rmsnorm dweight",
        &down(&cuda, &dw),
        &widen(&want_dw),
        1e-5,
        1e-4,
    );

    // SwiGLU: another exp, a few ulp.
    let n = 10_007;
    let (gate, upv, d) = (values(n, 68, 12.0), values(n, 69, 2.0), values(n, 70, 1.0));
    let (gd, ud, dd) = (up(&cuda, &gate), up(&cuda, &upv), up(&cuda, &d));
    let mut y = cuda.zeros([n], DType::F32).unwrap();
    cuda.swiglu_forward(&mut y, &gd, &ud).unwrap();
    let want: Vec<f64> = (0..n).map(|i| ref_swiglu(gate[i], upv[i]) as f64).collect();
    assert_close("swiglu", &down(&cuda, &y), &want, 1e-6, 1e-30);
    let (mut dg, mut du) = (
        cuda.zeros([n], DType::F32).unwrap(),
        cuda.zeros([n], DType::F32).unwrap(),
    );
    cuda.swiglu_backward(&mut dg, &mut du, &gd, &ud, &dd)
        .unwrap();
    let want: Vec<(f32, f32)> = (0..n)
        .map(|i| ref_swiglu_backward(0.0, 0.0, gate[i], upv[i], d[i]))
        .collect();
    let dgw: Vec<f64> = want.iter().map(|w| w.0 as f64).collect();
    let duw: Vec<f64> = want.iter().map(|w| w.1 as f64).collect();
    assert_close("swiglu dgate", &down(&cuda, &dg), &dgw, 1e-6, 1e-6);
    assert_close("swiglu dup", &down(&cuda, &du), &duw, 1e-6, 1e-6);

    // GeGLU (Gemma's gate): the GELU's operations, bitwise.
    let mut y = cuda.zeros([n], DType::F32).unwrap();
    cuda.geglu_forward(&mut y, &gd, &ud).unwrap();
    let want: Vec<f32> = (0..n).map(|i| ref_geglu(gate[i], upv[i])).collect();
    assert_bitwise("geglu", &down(&cuda, &y), &want);
    let (mut dg, mut du) = (
        cuda.zeros([n], DType::F32).unwrap(),
        cuda.zeros([n], DType::F32).unwrap(),
    );
    cuda.geglu_backward(&mut dg, &mut du, &gd, &ud, &dd)
        .unwrap();
    let (dgw, duw): (Vec<f32>, Vec<f32>) = (0..n)
        .map(|i| ref_geglu_backward(0.0, 0.0, gate[i], upv[i], d[i]))
        .unzip();
    assert_bitwise("geglu dgate", &down(&cuda, &dg), &dgw);
    assert_bitwise("geglu dup", &down(&cuda, &du), &duw);

    // Rotary embedding on the CPU's tables: bitwise, both directions.
    let (heads, t, hs) = (6usize, 33usize, 128usize);
    let x0 = values(heads * t * hs, 71, 3.0);
    let (cos, sin) = ref_rope_tables(t, hs, 500_000.0);
    let (cd, sd) = (
        cuda.upload(&cos, [t, hs / 2]).unwrap(),
        cuda.upload(&sin, [t, hs / 2]).unwrap(),
    );
    for inverse in [false, true] {
        let mut xd = cuda.upload(&x0, [1, heads, t, hs]).unwrap();
        cuda.rope(&mut xd, &cd, &sd, t, hs, inverse).unwrap();
        let mut want = x0.clone();
        ref_rope_apply(&mut want, t, hs, &cos, &sin, inverse);
        assert_bitwise("rope", &down(&cuda, &xd), &want);
    }

    // In-place rounding: bitwise the conversions.
    let mut xs = golden_inputs();
    xs.extend(values(3001, 72, 1e4));
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        let mut xd = up(&cuda, &xs);
        cuda.round_in_place(&mut xd, dtype).unwrap();
        assert_bitwise("round", &down(&cuda, &xd), &round_to(dtype, &xs));
    }

    // Bias-gradient column sums: to rounding, deterministic.
    let (rows, cols) = (300usize, 77usize);
    let xs = values(rows * cols, 73, 1.0);
    let d0 = values(cols, 74, 0.1);
    let got = twice(&|| {
        let mut dst = up(&cuda, &d0);
        cuda.column_sum(&mut dst, &cuda.upload(&xs, [rows, cols]).unwrap())
            .unwrap();
        down(&cuda, &dst)
    });
    let want: Vec<f64> = (0..cols)
        .map(|j| d0[j] as f64 + (0..rows).map(|i| xs[i * cols + j] as f64).sum::<f64>())
        .collect();
    assert_close("column sum", &got, &want, 1e-5, 1e-4);

    // Element ranges: exactly the range moves; a range past the end is refused.
    let src = up(&cuda, &values(100, 75, 1.0));
    let mut dst = cuda.zeros([50], DType::F32).unwrap();
    cuda.copy_elements(&src, 30, &mut dst, 10, 20).unwrap();
    let (s, d) = (down(&cuda, &src), down(&cuda, &dst));
    assert_eq!(&d[10..30], &s[30..50]);
    assert!(d[..10].iter().chain(&d[30..]).all(|&v| v == 0.0));
    assert!(cuda.copy_elements(&src, 90, &mut dst, 0, 20).is_err());
    assert!(cuda.copy_elements(&src, 0, &mut dst, 40, 20).is_err());
    assert_eq!(dst.numel(), 50);
}
