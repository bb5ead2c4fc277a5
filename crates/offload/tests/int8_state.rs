//! 8-bit AdamW tracks f32 AdamW on a small least-squares problem, and its state really is
//! about 2 bytes per parameter, as counted by the allocation hook.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use headroom_offload::{AdamWHyper, CpuAdamW, ParamSpec, StatePrecision, StoreSpec};
use headroom_tensor::cpu::kernels::FloatSlice;
use headroom_tensor::{AllocEvent, AllocHook, BoxedError, Cpu, MemoryCategory};

/// Fit w in y = X·w_true + noise (more rows than unknowns, so the loss has a floor at the noise
/// variance ≈ 3.3e-3) with mean squared error; returns the final loss.
fn train(precision: StatePrecision, steps: usize) -> f64 {
    // dim spans two quantisation blocks (2048 + 52).
    let (rows, dim) = (2400usize, 2100usize);
    let mut s = 12345u64;
    let mut rnd = || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        (s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    };
    let x: Vec<f32> = (0..rows * dim).map(|_| rnd()).collect();
    let w_true: Vec<f32> = (0..dim).map(|_| rnd() * 0.1).collect();
    let y: Vec<f32> = (0..rows)
        .map(|r| (0..dim).map(|c| x[r * dim + c] * w_true[c]).sum::<f32>() + 0.1 * rnd())
        .collect();

    let cpu = Cpu::new();
    let h = AdamWHyper {
        lr: 2e-3,
        weight_decay: 0.0,
        ..Default::default()
    };
    let mut opt = CpuAdamW::new(
        vec![h],
        &[ParamSpec {
            numel: dim,
            group: 0,
        }],
        precision,
        StoreSpec::Ram(&cpu),
    )
    .unwrap();
    let mut w = vec![0f32; dim];
    let mut loss = 0.0;
    for _ in 0..steps {
        let mut grad = vec![0f32; dim];
        loss = 0.0;
        for r in 0..rows {
            let row = &x[r * dim..(r + 1) * dim];
            let err: f32 = row.iter().zip(&w).map(|(a, b)| a * b).sum::<f32>() - y[r];
            loss += (err as f64).powi(2) / rows as f64;
            for (g, a) in grad.iter_mut().zip(row) {
                *g += 2.0 * err * a / rows as f32;
            }
        }
        opt.step(0, &mut w, FloatSlice::F32(&grad), None).unwrap();
    }
    loss
}

#[test]
fn int8_adamw_tracks_f32_adamw() {
    let initial = train(StatePrecision::F32, 1);
    let full = train(StatePrecision::F32, 120);
    let int8 = train(StatePrecision::Int8, 120);
    let float8 = train(StatePrecision::Float8, 120);
    eprintln!("loss: initial {initial:.4e}, f32 {full:.4e}, int8 {int8:.4e}, float8 {float8:.4e}");
    // Both make real progress, and 8-bit ends within 10% of f32's loss.
    assert!(
        full < 0.05 * initial,
        "f32 did not train: {initial} -> {full}"
    );
    assert!(
        int8 < 0.05 * initial,
        "int8 did not train: {initial} -> {int8}"
    );
    assert!(
        (int8 - full).abs() <= 0.10 * full,
        "f32 {full} vs int8 {int8}"
    );
    assert!(
        float8 < 0.05 * initial,
        "float8 did not train: {initial} -> {float8}"
    );
    assert!(
        (float8 - full).abs() <= 0.10 * full,
        "f32 {full} vs float8 {float8}"
    );
}

#[derive(Default)]
struct OptimizerBytes(AtomicUsize);
impl AllocHook for OptimizerBytes {
    fn on_alloc(&self, e: &AllocEvent) -> Result<(), BoxedError> {
        if e.category == MemoryCategory::OptimizerState {
            self.0.fetch_add(e.bytes, Ordering::Relaxed);
        }
        Ok(())
    }
    fn on_free(&self, e: &AllocEvent) {
        if e.category == MemoryCategory::OptimizerState {
            self.0.fetch_sub(e.bytes, Ordering::Relaxed);
        }
    }
}

#[test]
fn state_bytes_per_parameter_as_the_tracker_counts_them() {
    let hook = Arc::new(OptimizerBytes::default());
    let cpu = Cpu::new().with_alloc_hook(hook.clone());
    let specs: Vec<ParamSpec> = [1_000_000usize, 4096, 50_000]
        .iter()
        .map(|&n| ParamSpec { numel: n, group: 0 })
        .collect();
    let total: usize = specs.iter().map(|s| s.numel).sum();
    let f32_opt = CpuAdamW::new(
        vec![AdamWHyper::default()],
        &specs,
        StatePrecision::F32,
        StoreSpec::Ram(&cpu),
    )
    .unwrap();
    assert_eq!(hook.0.load(Ordering::Relaxed), 8 * total);
    drop(f32_opt);
    assert_eq!(hook.0.load(Ordering::Relaxed), 0);
    for precision in [StatePrecision::Int8, StatePrecision::Float8] {
        let eight_bit = CpuAdamW::new(
            vec![AdamWHyper::default()],
            &specs,
            precision,
            StoreSpec::Ram(&cpu),
        )
        .unwrap();
        let per_param = hook.0.load(Ordering::Relaxed) as f64 / total as f64;
        assert!(
            (2.0..2.01).contains(&per_param),
            "{precision:?}: {per_param}"
        );
        assert_eq!(per_param, eight_bit.state_bytes_per_param());
        drop(eight_bit);
        assert_eq!(hook.0.load(Ordering::Relaxed), 0);
    }
}

/// The 8-bit path is compiled once per ISA around the same IEEE-exact operations: every ISA
/// the machine has gives the same parameters and the same state bytes, including a block tail
/// and bf16 gradients.
/// AdamW over one tensor of `n` parameters with `precision` state, forced to `isa`, and the
/// tensor's starting values (the every-ISA tests' set-up).
fn one_tensor_on(
    cpu: &Cpu,
    n: usize,
    precision: StatePrecision,
    isa: headroom_offload::Isa,
) -> (CpuAdamW, Vec<f32>) {
    let opt = CpuAdamW::new(
        vec![AdamWHyper::default()],
        &[ParamSpec { numel: n, group: 0 }],
        precision,
        StoreSpec::Ram(cpu),
    )
    .unwrap()
    .with_isa(isa)
    .unwrap();
    (opt, (0..n).map(|i| (i as f32 * 0.01).cos()).collect())
}

#[test]
fn every_isa_gives_the_same_int8_bits() {
    use headroom_offload::Isa;
    let cpu = Cpu::new();
    let n = 2 * 2048 + 37;
    let grads: Vec<Vec<f32>> = (0..4u32)
        .map(|k| {
            (0..n)
                .map(|i| ((i as f32 * 0.37 + k as f32).sin() * 1e-2) * (1 + i % 7) as f32)
                .collect()
        })
        .collect();
    let run = |isa: Isa, precision: StatePrecision| {
        let (mut opt, mut w) = one_tensor_on(&cpu, n, precision, isa);
        for (k, g) in grads.iter().enumerate() {
            if k % 2 == 0 {
                opt.step(0, &mut w, FloatSlice::F32(g), None).unwrap();
            } else {
                let g16: Vec<half::bf16> = g.iter().map(|&x| half::bf16::from_f32(x)).collect();
                opt.step(0, &mut w, FloatSlice::BF16(&g16), None).unwrap();
            }
        }
        (
            w.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            opt.moments().to_vec(),
        )
    };
    for precision in [StatePrecision::Int8, StatePrecision::Float8] {
        let reference = run(Isa::Baseline, precision);
        for isa in [Isa::Avx2, Isa::Avx512] {
            if isa.is_supported() {
                assert!(
                    run(isa, precision) == reference,
                    "{precision:?}: {isa:?} differs from the baseline"
                );
            }
        }
    }
}

/// Non-finite gradients (NaN, ±∞) poison their blocks; every ISA poisons them alike: the same
/// state bytes (each code's documented saturation), and the same parameters up to NaN payloads.
#[test]
fn every_isa_handles_non_finite_gradients_alike() {
    use headroom_offload::Isa;
    let cpu = Cpu::new();
    // Block 0 finite, block 1 one NaN, block 2 one +∞ and one −∞, the tail a NaN.
    let n = 3 * 2048 + 21;
    let mut g: Vec<f32> = (0..n).map(|i| (i as f32 * 0.29).sin() * 1e-2).collect();
    g[2048 + 100] = f32::NAN;
    g[2 * 2048 + 5] = f32::INFINITY;
    g[2 * 2048 + 700] = f32::NEG_INFINITY;
    g[3 * 2048 + 3] = -f32::NAN;
    let run = |isa: Isa, precision: StatePrecision| {
        let (mut opt, mut w) = one_tensor_on(&cpu, n, precision, isa);
        for _ in 0..2 {
            opt.step(0, &mut w, FloatSlice::F32(&g), None).unwrap();
        }
        let w: Vec<u32> = w
            .iter()
            .map(|x| {
                if x.is_nan() {
                    f32::NAN.to_bits()
                } else {
                    x.to_bits()
                }
            })
            .collect();
        (w, opt.moments().to_vec())
    };
    for precision in [StatePrecision::Int8, StatePrecision::Float8] {
        let reference = run(Isa::Baseline, precision);
        assert!(reference.0[..2048]
            .iter()
            .all(|&b| f32::from_bits(b).is_finite()));
        assert!(reference.0[2048..]
            .iter()
            .any(|&b| f32::from_bits(b).is_nan()));
        for isa in [Isa::Avx2, Isa::Avx512] {
            if isa.is_supported() {
                let got = run(isa, precision);
                assert!(
                    got.0 == reference.0,
                    "{precision:?}: {isa:?} parameters differ"
                );
                assert!(
                    got.1 == reference.1,
                    "{precision:?}: {isa:?} state bytes differ"
                );
            }
        }
    }
}

/// The fused AVX2 8-bit kernel against the portable path over what the test above leaves out:
/// a lerp weight ≥ 0.5, f16 gradients, working copies in every precision, lengths around the
/// vector width and the block, an all-zero gradient block, values spread over many decades.
#[test]
fn every_isa_gives_the_same_int8_bits_for_every_shape_and_option() {
    use headroom_offload::Isa;
    use headroom_tensor::cpu::kernels::FloatSliceMut;
    let cpu = Cpu::new();
    let hypers = [
        AdamWHyper::default(),
        AdamWHyper {
            lr: 3e-2,
            beta1: 0.3,
            beta2: 0.9,
            eps: 1e-6,
            weight_decay: 0.1,
        },
    ];
    for n in [1usize, 7, 8, 9, 23, 2048, 2048 + 8 + 3, 3 * 2048 - 5] {
        let grads: Vec<Vec<f32>> = (0..5u32)
            .map(|k| {
                (0..n)
                    .map(|i| {
                        if k == 2 && i < 2048 {
                            return 0.0;
                        }
                        let mag = 10f32.powi(-(((i * 7 + k as usize) % 9) as i32));
                        (i as f32 * 0.61 + k as f32).sin() * mag
                    })
                    .collect()
            })
            .collect();
        let run = |isa: Isa, h: AdamWHyper, precision: StatePrecision| {
            let mut opt = CpuAdamW::new(
                vec![h],
                &[ParamSpec { numel: n, group: 0 }],
                precision,
                StoreSpec::Ram(&cpu),
            )
            .unwrap()
            .with_isa(isa)
            .unwrap();
            let mut w: Vec<f32> = (0..n).map(|i| (i as f32 * 0.013).cos()).collect();
            let mut copies = (
                vec![0f32; n],
                vec![half::bf16::ZERO; n],
                vec![half::f16::ZERO; n],
            );
            for (k, g) in grads.iter().enumerate() {
                let copy = match k % 3 {
                    0 => Some(FloatSliceMut::F32(&mut copies.0)),
                    1 => Some(FloatSliceMut::BF16(&mut copies.1)),
                    _ => Some(FloatSliceMut::F16(&mut copies.2)),
                };
                match k % 3 {
                    0 => opt.step(0, &mut w, FloatSlice::F32(g), copy).unwrap(),
                    1 => {
                        let g: Vec<half::bf16> =
                            g.iter().map(|&x| half::bf16::from_f32(x)).collect();
                        opt.step(0, &mut w, FloatSlice::BF16(&g), copy).unwrap()
                    }
                    _ => {
                        let g: Vec<half::f16> = g.iter().map(|&x| half::f16::from_f32(x)).collect();
                        opt.step(0, &mut w, FloatSlice::F16(&g), copy).unwrap()
                    }
                }
            }
            (
                w.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                opt.moments().to_vec(),
                copies.0.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                copies.1.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                copies.2.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            )
        };
        for (h, precision) in hypers
            .into_iter()
            .flat_map(|h| [(h, StatePrecision::Int8), (h, StatePrecision::Float8)])
        {
            let reference = run(Isa::Baseline, h, precision);
            for isa in [Isa::Avx2, Isa::Avx512] {
                if isa.is_supported() {
                    assert!(
                        run(isa, h, precision) == reference,
                        "{precision:?}: {isa:?} differs, n = {n}, {h:?}"
                    );
                }
            }
        }
    }
}

mod prop {
    use super::*;
    use headroom_offload::Isa;
    use headroom_tensor::cpu::kernels::FloatSliceMut;
    use proptest::prelude::*;

    fn hyper() -> impl Strategy<Value = AdamWHyper> {
        (
            1e-5f64..1e-1,
            // Both sides of a lerp weight of one half (ATen's two lerp formulas).
            0.0f64..0.99,
            0.5f64..0.9999,
            prop_oneof![Just(1e-8f64), 1e-10f64..1e-3],
            0.0f64..0.3,
        )
            .prop_map(|(lr, beta1, beta2, eps, weight_decay)| AdamWHyper {
                lr,
                beta1,
                beta2,
                eps,
                weight_decay,
            })
    }

    /// Lengths around the vector width, the block and two blocks, and anything up to three.
    fn sizes() -> impl Strategy<Value = usize> {
        prop_oneof![
            1usize..40,
            2030usize..2070,
            4080usize..4110,
            1usize..3 * 2048 + 20,
        ]
    }

    /// Pseudo-random values whose magnitudes spread over nine decades below `scale`, with
    /// every seventh one zero.
    fn data(seed: u64, n: usize, scale: f32) -> Vec<f32> {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|i| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                if i % 7 == 3 {
                    return 0.0;
                }
                let unit = (x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0;
                unit * scale * 10f32.powi(-(((x >> 8) % 9) as i32))
            })
            .collect()
    }

    type Run = (Vec<u32>, Vec<u8>, Vec<u32>);

    /// `steps` 8-bit steps with `isa`: the parameter bits, the moment bytes and the working
    /// copy's bits widened to u32 (empty without a copy).
    #[allow(clippy::too_many_arguments)]
    fn run(
        isa: Isa,
        precision: StatePrecision,
        h: AdamWHyper,
        n: usize,
        seed: u64,
        steps: usize,
        grad_kind: u8,
        copy_kind: u8,
    ) -> Run {
        let cpu = Cpu::new();
        let mut opt = CpuAdamW::new(
            vec![h],
            &[ParamSpec { numel: n, group: 0 }],
            precision,
            StoreSpec::Ram(&cpu),
        )
        .unwrap()
        .with_isa(isa)
        .unwrap();
        let mut w = data(seed ^ 0x5555, n, 1.0);
        let mut c32 = vec![0f32; n];
        let mut c16 = vec![half::bf16::ZERO; n];
        let mut ch = vec![half::f16::ZERO; n];
        for t in 0..steps {
            let g = data(seed.wrapping_add(t as u64 + 1), n, 0.1);
            let copy = match copy_kind {
                0 => None,
                1 => Some(FloatSliceMut::F32(&mut c32)),
                2 => Some(FloatSliceMut::BF16(&mut c16)),
                _ => Some(FloatSliceMut::F16(&mut ch)),
            };
            match grad_kind {
                0 => opt.step(0, &mut w, FloatSlice::F32(&g), copy).unwrap(),
                1 => {
                    let g: Vec<half::bf16> = g.iter().map(|&x| half::bf16::from_f32(x)).collect();
                    opt.step(0, &mut w, FloatSlice::BF16(&g), copy).unwrap()
                }
                _ => {
                    let g: Vec<half::f16> = g.iter().map(|&x| half::f16::from_f32(x)).collect();
                    opt.step(0, &mut w, FloatSlice::F16(&g), copy).unwrap()
                }
            }
        }
        let copy = match copy_kind {
            0 => vec![],
            1 => c32.iter().map(|x| x.to_bits()).collect(),
            2 => c16.iter().map(|x| x.to_bits() as u32).collect(),
            _ => ch.iter().map(|x| x.to_bits() as u32).collect(),
        };
        (
            w.iter().map(|x| x.to_bits()).collect(),
            opt.moments().to_vec(),
            copy,
        )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Every ISA's 8-bit step equals the portable scalar path bit for bit, for any length
        /// (vector tails, block tails), hyper-parameters, gradient precision and working copy.
        #[test]
        fn every_isa_equals_the_portable_int8_step(
            h in hyper(), n in sizes(), seed in any::<u64>(), steps in 1usize..4,
            grad_kind in 0u8..3, copy_kind in 0u8..4,
            precision in prop_oneof![Just(StatePrecision::Int8), Just(StatePrecision::Float8)],
        ) {
            let reference = run(Isa::Baseline, precision, h, n, seed, steps, grad_kind, copy_kind);
            for isa in [Isa::Avx2, Isa::Avx512] {
                if isa.is_supported() {
                    let got = run(isa, precision, h, n, seed, steps, grad_kind, copy_kind);
                    prop_assert!(got == reference, "{:?} {:?} differs, n = {}, {:?}", precision, isa, n, h);
                }
            }
        }
    }
}
