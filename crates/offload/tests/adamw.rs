//! AdamW against the scalar PyTorch-formula reference, across ISAs, thread counts, gradient
//! precisions, stores and the pipeline.
//!
//! Tolerance: none. Every path performs the same IEEE operations in the same order, with fused
//! multiply-adds in the same places (each a single rounding on any hardware), so f32 results
//! must be bit-identical to `reference::adamw_step` (a stronger statement than "within 1 ulp").
//! The reference itself is pinned to PyTorch's output in `torch_fixture.rs`.

use headroom_offload::{
    fused_step, reference, AdamWHyper, CpuAdamW, HostVec, Isa, OffloadError, OffloadPipeline,
    ParamSpec, StatePrecision, StepScalars, StoreSpec,
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

/// Every tail length of the 8- and 16-lane loops, the thread-chunk boundary, and several chunks.
fn sizes() -> impl Strategy<Value = usize> {
    prop_oneof![1usize..70, 32_760usize..32_790, 70_000usize..100_000]
}

const ISAS: [Isa; 3] = [Isa::Avx512, Isa::Avx2, Isa::Baseline];

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
        let (want, want_m, want_v) = reference_run(&h, &p0, &grads);
        for isa in ISAS.into_iter().filter(|isa| isa.is_supported()) {
            let mut opt = CpuAdamW::new(vec![h], &[ParamSpec { numel: n, group: 0 }], StatePrecision::F32, StoreSpec::Ram(&cpu)).unwrap().with_isa(isa).unwrap();
            prop_assert_eq!(opt.isa(), isa);
            let mut p = p0.clone();
            for g in &grads {
                opt.step(0, &mut p, FloatSlice::F32(g), None).unwrap();
            }
            prop_assert_eq!(bits(&p), bits(&want), "isa {:?}", isa);
            prop_assert_eq!(bits(opt.exp_avg(0).unwrap()), bits(&want_m), "isa {:?}", isa);
            prop_assert_eq!(bits(opt.exp_avg_sq(0).unwrap()), bits(&want_v), "isa {:?}", isa);
        }
    }

    /// `fused_step` itself, per ISA, from non-zero moments (as mid-run), with bf16 gradients
    /// too, over sizes that leave every possible vector tail.
    #[test]
    fn fused_step_on_every_isa_equals_the_reference(
        h in hyper(), n in 1usize..300, t in 1u64..2000, seed in any::<u64>(),
    ) {
        let s = StepScalars::new(h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, t);
        let p0 = data(seed, n, 1.0);
        let m0 = data(seed ^ 1, n, 0.01);
        let v0: Vec<f32> = data(seed ^ 2, n, 0.01).iter().map(|x| x * x).collect();
        let g32 = data(seed ^ 3, n, 0.1);
        let gb: Vec<bf16> = g32.iter().map(|&x| bf16::from_f32(x)).collect();
        let widened: Vec<f32> = gb.iter().map(|x| x.to_f32()).collect();
        for (g, want_g) in [(FloatSlice::F32(&g32), &g32), (FloatSlice::BF16(&gb), &widened)] {
            let (mut wp, mut wm, mut wv) = (p0.clone(), m0.clone(), v0.clone());
            reference::adamw_step(&s, &mut wp, want_g, &mut wm, &mut wv);
            for isa in ISAS.into_iter().filter(|isa| isa.is_supported()) {
                let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
                fused_step(isa, &s, &mut p, g, &mut m, &mut v, None).unwrap();
                prop_assert_eq!(bits(&p), bits(&wp), "isa {:?}", isa);
                prop_assert_eq!(bits(&m), bits(&wm), "isa {:?}", isa);
                prop_assert_eq!(bits(&v), bits(&wv), "isa {:?}", isa);
            }
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
        // Read from a stream (a checkpoint's file) into the store: the same optimizer.
        let moments = ram.moments().to_vec();
        let len = moments.len() as u64;
        let source = std::path::Path::new("optimizer.bin");
        let mut reader = std::io::Cursor::new(moments.clone());
        let streamed =
            CpuAdamW::restore_from_reader(&state, StoreSpec::Ram(&cpu), len, &mut reader, source)
                .unwrap();
        assert_eq!(streamed.moments(), &moments[..]);
        assert_eq!(streamed.state().params, ram.state().params);
        // A reader that ends early, and a length that is not the store's, are errors.
        let mut short = std::io::Cursor::new(moments[..moments.len() - 1].to_vec());
        assert!(matches!(
            CpuAdamW::restore_from_reader(&state, StoreSpec::Ram(&cpu), len, &mut short, source),
            Err(headroom_offload::OffloadError::Io { .. })
        ));
        let mut long = std::io::Cursor::new(moments);
        assert!(matches!(
            CpuAdamW::restore_from_reader(&state, StoreSpec::Ram(&cpu), len + 1, &mut long, source),
            Err(headroom_offload::OffloadError::StateMismatch(_))
        ));
    }
}

/// A file store's blocks are allocated when it is created and when it is reopened, not left
/// sparse: on a disk without room, a sparse mapping is a SIGBUS at the first store into a
/// page the file system cannot back, where a reservation is a typed error before any step.
#[cfg(target_os = "linux")]
#[test]
fn a_file_store_reserves_its_disk_blocks() {
    use std::os::unix::fs::MetadataExt;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.bin");
    let specs = [ParamSpec {
        numel: 1 << 20,
        group: 0,
    }];
    let allocated = |path: &std::path::Path| {
        let meta = std::fs::metadata(path).unwrap();
        (meta.blocks() * 512, meta.len())
    };
    let opt = CpuAdamW::new(
        vec![AdamWHyper::default()],
        &specs,
        StatePrecision::F32,
        StoreSpec::File(&path),
    )
    .unwrap();
    let state = opt.state();
    drop(opt);
    let (blocks, len) = allocated(&path);
    assert!(
        len > 8 << 20 && blocks >= len,
        "{blocks} of {len} bytes allocated"
    );

    // Made sparse again (as a copy or a restore may leave it), then reopened.
    let bytes = std::fs::read(&path).unwrap();
    std::fs::remove_file(&path).unwrap();
    let f = std::fs::File::create(&path).unwrap();
    f.set_len(len).unwrap();
    drop(f);
    let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    std::io::Write::write_all(&mut f, &bytes[..4096]).unwrap();
    drop(f);
    assert!(allocated(&path).0 < len / 2, "the copy is sparse");
    drop(CpuAdamW::reopen(&state, &path).unwrap());
    let (blocks, len) = allocated(&path);
    assert!(
        blocks >= len,
        "{blocks} of {len} bytes allocated after reopening"
    );
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

/// Two runs with the same state file (the command's default `optimizer-state.bin` in one
/// working directory): the second is refused by name while the first holds the file, and the
/// first's moments are untouched; once the first is gone the file can be taken again.
#[test]
fn a_state_file_in_use_is_refused_not_truncated() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("optimizer-state.bin");
    let specs = [ParamSpec {
        numel: 4096,
        group: 0,
    }];
    let new = || {
        CpuAdamW::new(
            vec![AdamWHyper::default()],
            &specs,
            StatePrecision::F32,
            StoreSpec::File(&path),
        )
    };
    let mut first = new().unwrap();
    let mut w = vec![1.0f32; 4096];
    first
        .step(0, &mut w, FloatSlice::F32(&vec![0.5f32; 4096]), None)
        .unwrap();
    first.flush().unwrap();
    let moments = first.moments().to_vec();
    assert!(moments.iter().any(|&b| b != 0));
    let on_disk = std::fs::read(&path).unwrap();

    match new() {
        Err(OffloadError::StateFileInUse { path: p }) => assert_eq!(p, path),
        other => panic!("a second store on a held file: {other:?}"),
    }
    let state = first.state();
    assert!(matches!(
        CpuAdamW::reopen(&state, &path),
        Err(OffloadError::StateFileInUse { .. })
    ));
    let e = new().unwrap_err().to_string();
    assert!(
        e.contains("optimizer-state.bin") && e.contains("in use"),
        "{e}"
    );
    assert_eq!(first.moments(), &moments[..]);
    assert_eq!(std::fs::read(&path).unwrap(), on_disk);

    drop(first);
    let reopened = CpuAdamW::reopen(&state, &path).unwrap();
    assert_eq!(reopened.moments(), &moments[..]);
    drop(reopened);
    // A new store on a released file starts from zero moments, as before.
    assert!(new().unwrap().moments().iter().all(|&b| b == 0));
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

#[test]
fn the_reference_lerp_is_exact_at_both_ends_and_takes_atens_branches() {
    // Weight 0 keeps the start, weight 1 gives the end exactly (the large-weight formula).
    assert_eq!(reference::lerp(3.0, 7.0, 0.0), 3.0);
    assert_eq!(reference::lerp(0.1, 1e30, 1.0), 1e30);
    // A small weight rounds once: fma(w, end - start, start), not start + round(w·diff).
    let (start, end, w) = (1.0f32, 1.0 + f32::EPSILON * 3.0, 0.1f32);
    let fused = w.mul_add(end - start, start);
    assert_eq!(reference::lerp(start, end, w), fused);
    // A weight of one half already takes the large-weight formula.
    let (start, end) = (0.3f32, 0.7f32);
    assert_eq!(
        reference::lerp(start, end, 0.5),
        (-0.5f32).mul_add(end - start, end)
    );
}

#[test]
fn step_scalars_are_pythons_double_arithmetic_rounded_to_f32() {
    let s = StepScalars::new(1e-3, 0.9, 0.999, 1e-8, 1e-2, 3);
    assert_eq!(s.decay, (1.0f64 - 1e-3 * 1e-2) as f32);
    assert_eq!(s.one_minus_beta1, (1.0f64 - 0.9) as f32);
    assert_eq!(s.beta2, 0.999f32);
    assert_eq!(s.one_minus_beta2, (1.0f64 - 0.999) as f32);
    // Small integer powers of the C library's pow are exact enough to pin here.
    assert_eq!(s.step_size, (1e-3 / (1.0 - 0.9f64 * 0.9 * 0.9)) as f32);
    assert_eq!(s.bc2_sqrt, (1.0 - 0.999f64 * 0.999 * 0.999).sqrt() as f32);
    assert_eq!(s.eps, 1e-8f32);
    assert!(s.lerp_weight_is_small());
    assert!(!StepScalars::new(1e-3, 0.5, 0.999, 1e-8, 0.0, 1).lerp_weight_is_small());
    // Step 0 is step 1; huge step counts give bias corrections of exactly one.
    assert_eq!(
        StepScalars::new(1e-3, 0.9, 0.95, 1e-8, 0.1, 0),
        StepScalars::new(1e-3, 0.9, 0.95, 1e-8, 0.1, 1)
    );
    let late = StepScalars::new(1e-3, 0.9, 0.95, 1e-8, 0.1, u64::MAX);
    assert_eq!((late.step_size, late.bc2_sqrt), (1e-3, 1.0));
}

#[test]
fn an_isa_the_cpu_lacks_is_a_typed_error_not_a_fallback() {
    let cpu = Cpu::new();
    let spec = [ParamSpec { numel: 5, group: 0 }];
    let opt = || {
        CpuAdamW::new(
            vec![AdamWHyper::default()],
            &spec,
            StatePrecision::F32,
            StoreSpec::Ram(&cpu),
        )
        .unwrap()
    };
    // The baseline runs everywhere, and the detected ISA is supported by definition.
    assert!(Isa::Baseline.is_supported());
    assert!(Isa::detect().is_supported());
    assert_eq!(opt().isa(), Isa::detect());
    assert_eq!(opt().with_isa(Isa::Baseline).unwrap().isa(), Isa::Baseline);
    let s = StepScalars::new(1e-3, 0.9, 0.999, 1e-8, 0.0, 1);
    let mut checked_one = false;
    for isa in ISAS {
        let (mut p, mut m, mut v) = (vec![1f32; 5], vec![0f32; 5], vec![0f32; 5]);
        let g = [0.5f32; 5];
        let direct = fused_step(isa, &s, &mut p, FloatSlice::F32(&g), &mut m, &mut v, None);
        if isa.is_supported() {
            direct.unwrap();
            assert_eq!(opt().with_isa(isa).unwrap().isa(), isa);
            continue;
        }
        checked_one = true;
        let e = direct.unwrap_err();
        assert!(
            matches!(e, OffloadError::UnsupportedIsa { isa: i, .. } if i == isa),
            "{e}"
        );
        assert!(e.to_string().contains(isa.required_features()), "{e}");
        // Nothing was written.
        assert_eq!((p[0], m[0], v[0]), (1.0, 0.0, 0.0));
        assert!(matches!(
            opt().with_isa(isa),
            Err(OffloadError::UnsupportedIsa { isa: i, .. }) if i == isa
        ));
    }
    // On a CPU with every ISA (AVX-512 machines) nothing above was refused; the error text
    // is still pinned through the public variant.
    if !checked_one {
        let e = OffloadError::UnsupportedIsa {
            isa: Isa::Avx512,
            features: Isa::Avx512.required_features(),
        };
        assert_eq!(
            e.to_string(),
            "this CPU cannot run the Avx512 AdamW kernel (it needs avx512f, fma)"
        );
    }
}

#[test]
fn fused_step_refuses_mismatched_lengths_without_writing() {
    let s = StepScalars::new(1e-3, 0.9, 0.999, 1e-8, 0.0, 1);
    let (mut p, mut m, mut v) = (vec![1f32; 4], vec![0f32; 4], vec![0f32; 4]);
    let isa = Isa::detect();
    let g3 = [0.5f32; 3];
    let g4 = [0.5f32; 4];
    let mut short_v = vec![0f32; 3];
    let mut copy = vec![bf16::ZERO; 5];
    let cases = [
        (
            "grad",
            fused_step(isa, &s, &mut p, FloatSlice::F32(&g3), &mut m, &mut v, None),
        ),
        (
            "v",
            fused_step(
                isa,
                &s,
                &mut p,
                FloatSlice::F32(&g4),
                &mut m,
                &mut short_v,
                None,
            ),
        ),
        (
            "working copy",
            fused_step(
                isa,
                &s,
                &mut p,
                FloatSlice::F32(&g4),
                &mut m,
                &mut v,
                Some(FloatSliceMut::BF16(&mut copy)),
            ),
        ),
    ];
    for (name, r) in cases {
        assert!(
            matches!(r, Err(OffloadError::LengthMismatch { what, .. }) if what == name),
            "{name}: {r:?}"
        );
    }
    assert_eq!((p, m, v), (vec![1f32; 4], vec![0f32; 4], vec![0f32; 4]));
}

#[test]
fn typed_moment_accessors_follow_the_documented_byte_layout() {
    let cpu = Cpu::new();
    let specs = [
        ParamSpec { numel: 3, group: 0 },
        ParamSpec { numel: 5, group: 0 },
    ];
    let mut opt = CpuAdamW::new(
        vec![AdamWHyper::default()],
        &specs,
        StatePrecision::F32,
        StoreSpec::Ram(&cpu),
    )
    .unwrap();
    for (i, spec) in specs.iter().enumerate() {
        let mut p = data(i as u64, spec.numel, 1.0);
        let g = data(i as u64 + 10, spec.numel, 0.1);
        opt.step(i, &mut p, FloatSlice::F32(&g), None).unwrap();
    }
    // `[exp_avg: N][exp_avg_sq: N]`, parameters in order within each half (N = 8).
    let all: Vec<f32> = opt
        .moments()
        .chunks_exact(4)
        .map(|b| f32::from_ne_bytes(b.try_into().unwrap()))
        .collect();
    assert_eq!(all.len(), 16);
    assert_eq!(opt.exp_avg(0).unwrap(), &all[0..3]);
    assert_eq!(opt.exp_avg(1).unwrap(), &all[3..8]);
    assert_eq!(opt.exp_avg_sq(0).unwrap(), &all[8..11]);
    assert_eq!(opt.exp_avg_sq(1).unwrap(), &all[11..16]);
    // After one step from zero, exp_avg = (1 - β1)·g and exp_avg_sq = (1 - β2)·g·g.
    let g = data(11, 5, 0.1);
    let s = StepScalars::new(1e-3, 0.9, 0.999, 1e-8, 1e-2, 1);
    let first = opt.exp_avg(1).unwrap().iter().zip(&g);
    for (m, &g) in first {
        assert_eq!(*m, reference::lerp(0.0, g, s.one_minus_beta1));
    }
    let second = opt.exp_avg_sq(1).unwrap().iter().zip(&g);
    for (v, &g) in second {
        assert_eq!(*v, (s.one_minus_beta2 * g) * g);
    }
    assert!(matches!(
        opt.exp_avg(2),
        Err(OffloadError::UnknownParam { index: 2, count: 2 })
    ));
    assert!(matches!(
        opt.exp_avg_sq(7),
        Err(OffloadError::UnknownParam { index: 7, count: 2 })
    ));

    // 8-bit moments have no f32 view.
    let int8 = CpuAdamW::new(
        vec![AdamWHyper::default()],
        &specs,
        StatePrecision::Int8,
        StoreSpec::Ram(&cpu),
    )
    .unwrap();
    for r in [int8.exp_avg(0), int8.exp_avg_sq(1)] {
        assert!(matches!(
            r,
            Err(OffloadError::MomentsNotF32 {
                precision: StatePrecision::Int8
            })
        ));
    }
    // `[m scales: B][√v scales: B][m codes: N][√v codes: N]`, one block per parameter here.
    assert_eq!(int8.moments().len(), 8 * 2 + 2 * 8);
}
