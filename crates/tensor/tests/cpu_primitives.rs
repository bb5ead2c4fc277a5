//! The CPU backend's primitives against the scalar references in `headroom_tensor::reference`
//! and against the `half` crate, over every class of float bit pattern.
//!
//! Tolerances: casts, scale, axpy and unscale are required to be bit-identical to the
//! reference (NaN compared as "is NaN", since payloads may differ between conversion paths);
//! sum of squares may differ from the sequential reference only by summation order, bounded by
//! a relative 1e-10 (n·ε for n ≤ 2^20 terms is ≈ 1e-10), and must be bitwise identical across
//! thread counts.

use headroom_tensor::reference::{self, ToF32Ref};
use headroom_tensor::{bf16, f16, Backend, Cpu, CpuTensor, DType, Element, Error};
use proptest::prelude::*;

/// Lengths that straddle the kernels' chunk (32768) and block (512) boundaries.
fn lengths() -> impl Strategy<Value = usize> {
    prop_oneof![
        0usize..40,
        500usize..530,
        32_760usize..32_780,
        65_530usize..65_545,
        70_000usize..140_000,
    ]
}

/// Lengths that also reach the threaded path (above `kernels::PAR_MIN`, 2^19 elements).
const _: () = assert!(headroom_tensor::cpu::kernels::PAR_MIN < 600_000);

fn lengths_threaded() -> impl Strategy<Value = usize> {
    prop_oneof![lengths(), 600_000usize..1_100_000]
}

/// An f32 drawn from one of the bit-pattern classes that conversions must get right.
fn f32_any_class() -> impl Strategy<Value = f32> {
    prop_oneof![
        // Normal f32 values over the whole exponent range.
        any::<u32>().prop_map(f32::from_bits),
        // Values around f16's range: normal, subnormal and overflowing f16.
        (-70_000f32..70_000f32),
        (-1e-4f32..1e-4f32),
        (-1e-7f32..1e-7f32),
        // f32 subnormals.
        (0u32..0x0080_0000, any::<bool>())
            .prop_map(|(m, s)| f32::from_bits(m | if s { 0x8000_0000 } else { 0 })),
        // Ties: exactly halfway between two bf16 values.
        // (`hi` odd and even both occur, so ties round both up and down.)
        any::<u16>().prop_map(|hi| f32::from_bits(((hi as u32) << 16) | 0x8000)),
        Just(0.0f32),
        Just(-0.0f32),
        Just(f32::INFINITY),
        Just(f32::NEG_INFINITY),
        Just(f32::NAN),
        Just(-f32::NAN),
        Just(f32::MAX),
        Just(f32::MIN_POSITIVE),
        // Signalling NaN patterns.
        (1u32..0x0040_0000).prop_map(|m| f32::from_bits(0x7f80_0000 | m)),
    ]
}

fn finite_f32() -> impl Strategy<Value = f32> {
    prop_oneof![
        -1e3f32..1e3f32,
        -1e-3f32..1e-3f32,
        Just(0.0f32),
        Just(-0.0f32)
    ]
}

fn same_bits<T: ToF32Ref + Element>(a: &[T], b: &[T]) -> Result<(), TestCaseError> {
    prop_assert_eq!(a.len(), b.len());
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let (fx, fy) = (x.to_f32_ref(), y.to_f32_ref());
        if fx.is_nan() || fy.is_nan() {
            prop_assert!(fx.is_nan() && fy.is_nan(), "index {i}: {fx} vs {fy}");
        } else {
            prop_assert_eq!(
                bytemuck::bytes_of(x),
                bytemuck::bytes_of(y),
                "index {}: {:?} vs {:?}",
                i,
                x,
                y
            );
        }
    }
    Ok(())
}

fn cast_via_backend<S: Element, D: Element>(cpu: &Cpu, src: &[S]) -> Vec<D> {
    let s = cpu.upload(src, [src.len()]).unwrap();
    let mut d = cpu.zeros([src.len()], D::DTYPE).unwrap();
    cpu.cast(&s, &mut d).unwrap();
    cpu.download(&d).unwrap()
}

#[test]
fn widening_casts_are_exact_for_every_16_bit_pattern() {
    let cpu = Cpu::new();
    let all_f16: Vec<f16> = (0..=u16::MAX).map(f16::from_bits).collect();
    let all_bf16: Vec<bf16> = (0..=u16::MAX).map(bf16::from_bits).collect();

    let got: Vec<f32> = cast_via_backend(&cpu, &all_f16);
    same_bits(&got, &reference::cast::<f16, f32>(&all_f16)).unwrap();
    let got: Vec<f32> = cast_via_backend(&cpu, &all_bf16);
    same_bits(&got, &reference::cast::<bf16, f32>(&all_bf16)).unwrap();

    // Every 16-bit value survives a round trip through f32 unchanged (NaN stays NaN).
    let back: Vec<f16> = cast_via_backend(&cpu, &cast_via_backend::<f16, f32>(&cpu, &all_f16));
    same_bits(&back, &all_f16).unwrap();
    let back: Vec<bf16> = cast_via_backend(&cpu, &cast_via_backend::<bf16, f32>(&cpu, &all_bf16));
    same_bits(&back, &all_bf16).unwrap();

    // And across 16-bit formats, against half's scalar conversions.
    let got: Vec<bf16> = cast_via_backend(&cpu, &all_f16);
    same_bits(&got, &reference::cast::<f16, bf16>(&all_f16)).unwrap();
    let got: Vec<f16> = cast_via_backend(&cpu, &all_bf16);
    same_bits(&got, &reference::cast::<bf16, f16>(&all_bf16)).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn narrowing_casts_match_half(len in lengths_threaded(), seed in prop::collection::vec(f32_any_class(), 1..64)) {
        let cpu = Cpu::new();
        let src: Vec<f32> = (0..len).map(|i| seed[i % seed.len()]).collect();
        let got: Vec<bf16> = cast_via_backend(&cpu, &src);
        same_bits(&got, &reference::cast::<f32, bf16>(&src))?;
        let got: Vec<f16> = cast_via_backend(&cpu, &src);
        same_bits(&got, &reference::cast::<f32, f16>(&src))?;
        for (x, y) in src.iter().zip(&got) {
            if x.is_nan() { prop_assert!(y.is_nan()); }
        }
    }

    /// The in-place rounding (a head's logits, one row at a time) is `half`'s round trip
    /// through bf16, on the widest path allowed here, at lengths with every vector tail.
    #[test]
    fn rounding_in_place_is_a_bf16_round_trip(len in lengths(), seed in prop::collection::vec(f32_any_class(), 1..64)) {
        let mut x: Vec<f32> = (0..len).map(|i| seed[i % seed.len()]).collect();
        let want: Vec<f32> = x.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
        headroom_tensor::cpu::kernels::round_to_bf16_in_place(&mut x);
        same_bits(&x, &want)?;
    }

    #[test]
    fn scale_matches_reference(
        len in lengths(),
        seed in prop::collection::vec(f32_any_class(), 1..64),
        alpha in prop_oneof![-4f32..4f32, Just(0.0f32), Just(65536.0f32), Just(1.0 / 65536.0)],
    ) {
        let cpu = Cpu::new();
        let x: Vec<f32> = (0..len).map(|i| seed[i % seed.len()]).collect();
        let mut t = cpu.upload(&x, [len]).unwrap();
        cpu.scale(&mut t, alpha).unwrap();
        same_bits(&cpu.download::<f32>(&t).unwrap(), &reference::scale(&x, alpha))?;

        let xb: Vec<bf16> = reference::cast(&x);
        let mut t = cpu.upload(&xb, [len]).unwrap();
        cpu.scale(&mut t, alpha).unwrap();
        same_bits(&cpu.download::<bf16>(&t).unwrap(), &reference::scale(&xb, alpha))?;

        let xh: Vec<f16> = reference::cast(&x);
        let mut t = cpu.upload(&xh, [len]).unwrap();
        cpu.scale(&mut t, alpha).unwrap();
        same_bits(&cpu.download::<f16>(&t).unwrap(), &reference::scale(&xh, alpha))?;
    }

    #[test]
    fn axpy_matches_reference(
        len in lengths_threaded(),
        xs in prop::collection::vec(finite_f32(), 1..64),
        ys in prop::collection::vec(finite_f32(), 1..64),
        alpha in -3f32..3f32,
    ) {
        let cpu = Cpu::new();
        let x: Vec<f32> = (0..len).map(|i| xs[i % xs.len()]).collect();
        let y: Vec<f32> = (0..len).map(|i| ys[(i * 7) % ys.len()]).collect();

        fn run<T: Element + ToF32Ref>(cpu: &Cpu, alpha: f32, x: &[T], y: &[f32]) -> Result<(), TestCaseError> {
            let xt = cpu.upload(x, [x.len()]).unwrap();
            let mut yt = cpu.upload(y, [y.len()]).unwrap();
            cpu.axpy(alpha, &xt, &mut yt).unwrap();
            same_bits(&cpu.download::<f32>(&yt).unwrap(), &reference::axpy(alpha, x, y))
        }
        run(&cpu, alpha, &x, &y)?;
        run(&cpu, alpha, &reference::cast::<f32, bf16>(&x), &y)?;
        run(&cpu, alpha, &reference::cast::<f32, f16>(&x), &y)?;
    }

    #[test]
    fn sum_squares_matches_reference_and_ignores_thread_count(
        len in lengths_threaded(),
        xs in prop::collection::vec(-1e4f32..1e4f32, 1..97),
    ) {
        let x: Vec<f32> = (0..len).map(|i| xs[i % xs.len()] * (1.0 + (i % 13) as f32 * 1e-3)).collect();
        let xb: Vec<bf16> = reference::cast(&x);
        let xh: Vec<f16> = reference::cast(&x);
        let mut results: Vec<[u64; 3]> = Vec::new();
        for threads in [1, 2, 7] {
            let cpu = Cpu::with_threads(threads).unwrap();
            let a = cpu.sum_squares(&cpu.upload(&x, [len]).unwrap()).unwrap();
            let b = cpu.sum_squares(&cpu.upload(&xb, [len]).unwrap()).unwrap();
            let h = cpu.sum_squares(&cpu.upload(&xh, [len]).unwrap()).unwrap();
            for (got, want) in [(a, reference::sum_squares(&x)), (b, reference::sum_squares(&xb)), (h, reference::sum_squares(&xh))] {
                let tol = 1e-10 * want.abs();
                prop_assert!((got - want).abs() <= tol, "{} vs {}", got, want);
            }
            results.push([a.to_bits(), b.to_bits(), h.to_bits()]);
        }
        prop_assert_eq!(results[0], results[1]);
        prop_assert_eq!(results[0], results[2]);
    }

    #[test]
    fn unscale_finds_one_planted_non_finite_anywhere(
        len in lengths_threaded().prop_filter("non-empty", |n| *n > 0),
        pos_frac in 0.0f64..1.0,
        bad in prop_oneof![Just(f32::INFINITY), Just(f32::NEG_INFINITY), Just(f32::NAN)],
        xs in prop::collection::vec(finite_f32(), 1..64),
    ) {
        let cpu = Cpu::new();
        let pos = ((len as f64 * pos_frac) as usize).min(len - 1);
        let inv = 1.0f32 / 1024.0;
        let clean: Vec<f32> = (0..len).map(|i| xs[i % xs.len()]).collect();
        let mut planted = clean.clone();
        planted[pos] = bad;

        fn run<T: Element + ToF32Ref>(cpu: &Cpu, x: &[T], inv: f32) -> Result<bool, TestCaseError> {
            let mut t = cpu.upload(x, [x.len()]).unwrap();
            let found = cpu.unscale_and_check(&mut [&mut t], inv).unwrap();
            let (want, want_found) = reference::unscale_and_check(x, inv);
            same_bits(&cpu.download::<T>(&t).unwrap(), &want)?;
            prop_assert_eq!(found, want_found);
            Ok(found)
        }
        prop_assert!(!run(&cpu, &clean, inv)?);
        prop_assert!(run(&cpu, &planted, inv)?);
        prop_assert!(run(&cpu, &reference::cast::<f32, bf16>(&planted), inv)?);
        prop_assert!(run(&cpu, &reference::cast::<f32, f16>(&planted), inv)?);
        prop_assert!(!run(&cpu, &reference::cast::<f32, bf16>(&clean), inv)?);
    }
}

#[test]
fn unscale_reports_across_a_set_of_tensors() {
    let cpu = Cpu::new();
    let mut a = cpu.upload(&[1.0f32, 2.0], [2]).unwrap();
    let mut b = cpu
        .upload(&[bf16::from_f32(4.0), bf16::INFINITY], [2])
        .unwrap();
    let found = cpu.unscale_and_check(&mut [&mut a, &mut b], 0.5).unwrap();
    assert!(found);
    assert_eq!(cpu.download::<f32>(&a).unwrap(), [0.5, 1.0]);
    assert_eq!(cpu.download::<bf16>(&b).unwrap()[0], bf16::from_f32(2.0));
}

#[test]
fn bad_input_is_a_typed_error_and_changes_nothing() {
    let cpu = Cpu::new();
    let x = cpu.upload(&[1.0f32, 2.0, 3.0], [3]).unwrap();
    let mut y2 = cpu.zeros([2], DType::F32).unwrap();
    assert!(matches!(
        cpu.axpy(1.0, &x, &mut y2),
        Err(Error::LengthMismatch { .. })
    ));
    let mut yb = cpu.zeros([3], DType::BF16).unwrap();
    assert!(matches!(
        cpu.axpy(1.0, &x, &mut yb),
        Err(Error::DTypeMismatch { .. })
    ));
    let ints = cpu.upload(&[1u32, 2, 3], [3]).unwrap();
    assert!(matches!(
        cpu.sum_squares(&ints),
        Err(Error::UnsupportedDType { .. })
    ));
    let mut f = cpu.zeros([3], DType::F32).unwrap();
    assert!(matches!(
        cpu.cast(&ints, &mut f),
        Err(Error::UnsupportedDType { .. })
    ));
    assert!(matches!(
        cpu.upload(&[1.0f32; 5], [2, 3]),
        Err(Error::LengthMismatch { .. })
    ));
    assert!(matches!(
        cpu.download::<bf16>(&x),
        Err(Error::DTypeMismatch { .. })
    ));
    assert!(matches!(
        cpu.zeros([usize::MAX / 2, 4], DType::F32),
        Err(Error::SizeOverflow { .. })
    ));
    assert!(matches!(
        cpu.zeros([1usize << 60], DType::F32),
        Err(Error::OutOfMemory { .. })
    ));

    // A set with one integer tensor is rejected before any tensor is modified.
    let mut good = cpu.upload(&[8.0f32], [1]).unwrap();
    let mut bad: CpuTensor = cpu.upload(&[1u32], [1]).unwrap();
    assert!(cpu
        .unscale_and_check(&mut [&mut good, &mut bad], 0.5)
        .is_err());
    assert_eq!(cpu.download::<f32>(&good).unwrap(), [8.0]);
}
