//! AdamW against the scalar PyTorch-formula reference, across ISAs, thread counts, gradient
//! precisions, stores and the pipeline.
//!
//! Tolerance: none. Every path performs the same IEEE operations in the same order without
//! fused multiply-add, so f32 results must be bit-identical to `reference::adamw_step` (a
//! stronger statement than "within 1 ulp").

use headroom_offload::{
    reference, AdamWHyper, CpuAdamW, HostVec, Isa, OffloadPipeline, ParamSpec, StatePrecision,
    StepScalars, StoreSpec,
};
use headroom_tensor::cpu::kernels::{FloatSlice, FloatSliceMut};
use headroom_tensor::{bf16, f16, Cpu};
use proptest::prelude::*;

fn hyper() -> impl Strategy<Value = AdamWHyper> {
    (
        1e-5f64..1e-1,
        0.0f64..0.99,
        0.9f64..0.9999,
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

/// Deterministic pseudo-random data (proptest picks the seed).
fn data(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
        })
        .collect()
}

fn sizes() -> impl Strategy<Value = usize> {
    prop_oneof![1usize..70, 32_760usize..32_790, 70_000usize..100_000]
}

fn reference_run(h: &AdamWHyper, p0: &[f32], grads: &[Vec<f32>]) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (mut p, mut m, mut v) = (p0.to_vec(), vec![0f32; p0.len()], vec![0f32; p0.len()]);
    for (t, g) in grads.iter().enumerate() {
        let s = StepScalars::new(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, t as u64 + 1);
        reference::adamw_step(&s, &mut p, g, &mut m, &mut v);
    }
    (p, m, v)
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(40))]

    #[test]
    fn every_isa_equals_the_scalar_reference_bit_for_bit(
        h in hyper(), n in sizes(), steps in 1usize..6, seed in any::<u64>(),
    ) {
        let cpu = Cpu::new();
        let p0 = data(seed, n, 1.0);
        let grads: Vec<Vec<f32>> = (0..steps).map(|t| data(seed ^ (t as u64 + 1), n, 0.1)).collect();
        let (want, want_m, _) = reference_run(&h, &p0, &grads);
        for isa in [Isa::Avx512, Isa::Avx2, Isa::Baseline] {
            if !isa.is_supported() { continue; }
            let mut opt = CpuAdamW::new(vec![h], &[ParamSpec { numel: n, group: 0 }], StatePrecision::F32, StoreSpec::Ram(&cpu)).unwrap().with_isa(isa);
            let mut p = p0.clone();
            for g in &grads {
                opt.step(0, &mut p, FloatSlice::F32(g), None).unwrap();
            }
            prop_assert_eq!(bits(&p), bits(&want), "isa {:?}", isa);
            let m: &[f32] = bytemuck::cast_slice(&opt.moments()[..4 * n]);
            prop_assert_eq!(bits(m), bits(&want_m));
        }
    }

    #[test]
    fn half_gradients_and_working_copies_match_the_reference(
        h in hyper(), n in sizes(), seed in any::<u64>(),
    ) {
        let cpu = Cpu::new();
        let p0 = data(seed, n, 1.0);
        let g32 = data(!seed, n, 0.05);
        let gb: Vec<bf16> = g32.iter().map(|&x| bf16::from_f32(x)).collect();
        let gh: Vec<f16> = g32.iter().map(|&x| f16::from_f32(x)).collect();
        let spec = [ParamSpec { numel: n, group: 0 }];
        // bf16 gradients: the reference sees the widened values.
        let widened: Vec<f32> = gb.iter().map(|x| x.to_f32()).collect();
        let (want, _, _) = reference_run(&h, &p0, std::slice::from_ref(&widened));
        let mut opt = CpuAdamW::new(vec![h], &spec, StatePrecision::F32, StoreSpec::Ram(&cpu)).unwrap();
        let mut p = p0.clone();
        let mut copy = vec![bf16::ZERO; n];
        opt.step(0, &mut p, FloatSlice::BF16(&gb), Some(FloatSliceMut::BF16(&mut copy))).unwrap();
        prop_assert_eq!(bits(&p), bits(&want));
        prop_assert!(copy.iter().zip(&p).all(|(c, p)| *c == bf16::from_f32(*p)));

        let widened: Vec<f32> = gh.iter().map(|x| x.to_f32()).collect();
        let (want, _, _) = reference_run(&h, &p0, std::slice::from_ref(&widened));
        let mut opt = CpuAdamW::new(vec![h], &spec, StatePrecision::F32, StoreSpec::Ram(&cpu)).unwrap();
        let mut p = p0.clone();
        let mut copy = vec![f16::ZERO; n];
        opt.step(0, &mut p, FloatSlice::F16(&gh), Some(FloatSliceMut::F16(&mut copy))).unwrap();
        prop_assert_eq!(bits(&p), bits(&want));
        prop_assert!(copy.iter().zip(&p).all(|(c, p)| c.to_bits() == f16::from_f32(*p).to_bits()));
    }

    #[test]
    fn thread_count_does_not_change_a_bit(h in hyper(), n in 40_000usize..140_000, seed in any::<u64>()) {
        let cpu = Cpu::new();
        let p0 = data(seed, n, 1.0);
        let g = data(seed.rotate_left(7), n, 0.1);
        let mut results = Vec::new();
        for precision in [StatePrecision::F32, StatePrecision::Int8] {
            for threads in [1, 2, 7] {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                let mut opt = CpuAdamW::new(vec![h], &[ParamSpec { numel: n, group: 0 }], precision, StoreSpec::Ram(&cpu)).unwrap();
                let mut p = p0.clone();
                pool.install(|| {
                    for _ in 0..3 {
                        opt.step(0, &mut p, FloatSlice::F32(&g), None).unwrap();
                    }
                });
                results.push((precision, bits(&p), opt.moments().to_vec()));
            }
        }
        prop_assert!(results[0] == results[1] && results[1] == results[2]);
        prop_assert!(results[3] == results[4] && results[4] == results[5]);
    }
}

#[test]
fn file_store_equals_ram_and_survives_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("moments.bin");
    let cpu = Cpu::new();
    let h = AdamWHyper::default();
    let specs = [
        ParamSpec {
            numel: 5000,
            group: 0,
        },
        ParamSpec {
            numel: 77,
            group: 1,
        },
    ];
    let groups = vec![h, AdamWHyper { lr: 3e-3, ..h }];
    for precision in [StatePrecision::F32, StatePrecision::Int8] {
        let mut ram =
            CpuAdamW::new(groups.clone(), &specs, precision, StoreSpec::Ram(&cpu)).unwrap();
        let mut file =
            CpuAdamW::new(groups.clone(), &specs, precision, StoreSpec::File(&path)).unwrap();
        let mut pr: Vec<Vec<f32>> = specs
            .iter()
            .map(|s| data(s.numel as u64, s.numel, 1.0))
            .collect();
        let mut pf = pr.clone();
        let step_all = |opt: &mut CpuAdamW, p: &mut Vec<Vec<f32>>, t: u64| {
            for (i, s) in specs.iter().enumerate() {
                let g = data(t * 31 + i as u64, s.numel, 0.1);
                opt.step(i, &mut p[i], FloatSlice::F32(&g), None).unwrap();
            }
        };
        for t in 0..3 {
            step_all(&mut ram, &mut pr, t);
            step_all(&mut file, &mut pf, t);
        }
        assert_eq!(pr, pf);
        assert_eq!(ram.moments(), file.moments());
        file.flush().unwrap();
        let state = file.state();
        drop(file);

        let mut reopened = CpuAdamW::reopen(&state, &path).unwrap();
        for t in 3..5 {
            step_all(&mut ram, &mut pr, t);
            step_all(&mut reopened, &mut pf, t);
        }
        assert_eq!(pr, pf, "{precision:?}");
        assert_eq!(ram.moments(), reopened.moments());

        // RAM state round-trips through serde + moment bytes too.
        let json = serde_json::to_string(&ram.state()).unwrap();
        let restored =
            CpuAdamW::restore(&serde_json::from_str(&json).unwrap(), &cpu, ram.moments()).unwrap();
        assert_eq!(restored.state(), ram.state());
    }
}

#[test]
fn corrupt_or_foreign_state_files_are_refused() {
    use headroom_offload::OffloadError;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.bin");
    let specs = [ParamSpec {
        numel: 100,
        group: 0,
    }];
    let mut opt = CpuAdamW::new(
        vec![AdamWHyper::default()],
        &specs,
        StatePrecision::F32,
        StoreSpec::File(&path),
    )
    .unwrap();
    opt.flush().unwrap();
    let state = opt.state();
    drop(opt);

    // Another model's layout.
    let mut other = state.clone();
    other.params[0].numel = 101;
    assert!(matches!(
        CpuAdamW::reopen(&other, &path),
        Err(OffloadError::CorruptStateFile { .. })
    ));
    // Another precision.
    let mut other = state.clone();
    other.precision = StatePrecision::Int8;
    assert!(matches!(
        CpuAdamW::reopen(&other, &path),
        Err(OffloadError::CorruptStateFile { .. })
    ));
    // Truncated.
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 4]).unwrap();
    assert!(matches!(
        CpuAdamW::reopen(&state, &path),
        Err(OffloadError::CorruptStateFile { .. })
    ));
    std::fs::write(&path, &bytes[..100]).unwrap();
    assert!(matches!(
        CpuAdamW::reopen(&state, &path),
        Err(OffloadError::CorruptStateFile { .. })
    ));
    // Wrong magic.
    let mut bad = bytes.clone();
    bad[0] ^= 0xff;
    std::fs::write(&path, &bad).unwrap();
    assert!(matches!(
        CpuAdamW::reopen(&state, &path),
        Err(OffloadError::CorruptStateFile { .. })
    ));
    // Missing.
    assert!(matches!(
        CpuAdamW::reopen(&state, &dir.path().join("none")),
        Err(OffloadError::Io { .. })
    ));
    // Intact file still opens.
    std::fs::write(&path, &bytes).unwrap();
    CpuAdamW::reopen(&state, &path).unwrap();
}

#[test]
fn bad_arguments_are_typed_errors() {
    use headroom_offload::OffloadError;
    let cpu = Cpu::new();
    let bad = AdamWHyper {
        beta1: 1.0,
        ..Default::default()
    };
    assert!(matches!(
        CpuAdamW::new(vec![bad], &[], StatePrecision::F32, StoreSpec::Ram(&cpu)),
        Err(OffloadError::InvalidHyper { name: "beta1", .. })
    ));
    assert!(matches!(
        CpuAdamW::new(
            vec![AdamWHyper::default()],
            &[ParamSpec { numel: 3, group: 2 }],
            StatePrecision::F32,
            StoreSpec::Ram(&cpu)
        ),
        Err(OffloadError::UnknownGroup { .. })
    ));
    let mut opt = CpuAdamW::new(
        vec![AdamWHyper::default()],
        &[ParamSpec { numel: 3, group: 0 }],
        StatePrecision::F32,
        StoreSpec::Ram(&cpu),
    )
    .unwrap();
    let mut p = vec![0f32; 3];
    assert!(matches!(
        opt.step(0, &mut p, FloatSlice::F32(&[0.0; 2]), None),
        Err(OffloadError::LengthMismatch { what: "grad", .. })
    ));
    assert!(matches!(
        opt.step(1, &mut p, FloatSlice::F32(&[0.0; 3]), None),
        Err(OffloadError::UnknownParam { .. })
    ));
    assert!(matches!(
        opt.set_lr(0, f64::NAN),
        Err(OffloadError::InvalidHyper { .. })
    ));
    // Nothing above advanced the step counter.
    assert_eq!(opt.state().steps, vec![0]);
}

#[test]
fn pipeline_equals_serial_steps_bitwise() {
    let cpu = Cpu::new();
    let specs: Vec<ParamSpec> = (0..6)
        .map(|i| ParamSpec {
            numel: 1000 + 3000 * i,
            group: i % 2,
        })
        .collect();
    let groups = vec![
        AdamWHyper::default(),
        AdamWHyper {
            lr: 5e-3,
            weight_decay: 0.0,
            ..Default::default()
        },
    ];
    let masters: Vec<Vec<f32>> = specs
        .iter()
        .map(|s| data(s.numel as u64, s.numel, 1.0))
        .collect();
    let grads = |step: u64, i: usize| data(step * 1000 + i as u64, specs[i].numel, 0.1);

    // Serial.
    let mut serial = CpuAdamW::new(
        groups.clone(),
        &specs,
        StatePrecision::F32,
        StoreSpec::Ram(&cpu),
    )
    .unwrap();
    let mut ps = masters.clone();
    let mut serial_copies = vec![Vec::new(); specs.len()];
    for step in 0..3 {
        for i in 0..specs.len() {
            let mut c = vec![bf16::ZERO; specs[i].numel];
            serial
                .step(
                    i,
                    &mut ps[i],
                    FloatSlice::F32(&grads(step, i)),
                    Some(FloatSliceMut::BF16(&mut c)),
                )
                .unwrap();
            serial_copies[i] = c;
        }
    }

    // Pipelined: buckets in reverse layer order, as backward finishes them.
    let opt = CpuAdamW::new(groups, &specs, StatePrecision::F32, StoreSpec::Ram(&cpu)).unwrap();
    let buckets = vec![vec![5, 4], vec![3], vec![2, 1, 0]];
    let pipe = OffloadPipeline::spawn(opt, masters, buckets.clone(), 2).unwrap();
    let mut copies = vec![Vec::new(); specs.len()];
    for step in 0..3 {
        for (b, params) in buckets.iter().enumerate() {
            let g = params
                .iter()
                .map(|&i| HostVec::F32(grads(step, i)))
                .collect();
            let c = params
                .iter()
                .map(|&i| HostVec::BF16(vec![bf16::ZERO; specs[i].numel]))
                .collect();
            pipe.submit(b, g, c).unwrap();
        }
        for _ in 0..buckets.len() {
            let done = pipe.recv().unwrap();
            for (&i, c) in buckets[done.bucket].iter().zip(done.copies) {
                let HostVec::BF16(c) = c else {
                    panic!("copy precision changed")
                };
                copies[i] = c;
            }
        }
    }
    let (opt, pp) = pipe.shutdown().unwrap();
    assert_eq!(pp, ps);
    assert_eq!(copies, serial_copies);
    assert_eq!(opt.moments(), serial.moments());
}

#[test]
fn pipeline_rejects_malformed_buckets() {
    let cpu = Cpu::new();
    let specs = [
        ParamSpec { numel: 4, group: 0 },
        ParamSpec { numel: 2, group: 0 },
    ];
    let mk = || {
        CpuAdamW::new(
            vec![AdamWHyper::default()],
            &specs,
            StatePrecision::F32,
            StoreSpec::Ram(&cpu),
        )
        .unwrap()
    };
    let masters = vec![vec![0f32; 4], vec![0f32; 2]];
    assert!(OffloadPipeline::spawn(mk(), masters.clone(), vec![vec![0, 0]], 1).is_err());
    assert!(OffloadPipeline::spawn(mk(), masters.clone(), vec![vec![2]], 1).is_err());
    assert!(OffloadPipeline::spawn(mk(), vec![vec![0f32; 4]], vec![vec![0]], 1).is_err());
    let pipe = OffloadPipeline::spawn(mk(), masters, vec![vec![0], vec![1]], 1).unwrap();
    assert!(pipe
        .submit(
            0,
            vec![HostVec::F32(vec![0.0; 3])],
            vec![HostVec::F32(vec![0.0; 4])]
        )
        .is_err());
    assert!(pipe.submit(2, vec![], vec![]).is_err());
    pipe.submit(
        1,
        vec![HostVec::F32(vec![1.0; 2])],
        vec![HostVec::F32(vec![0.0; 2])],
    )
    .unwrap();
    let done = pipe.recv().unwrap();
    assert_eq!(done.bucket, 1);
}
