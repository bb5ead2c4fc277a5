//! [`Quantizer`] (chunk by chunk) against [`QuantizedTensor::quantize`] (whole): the same
//! packed bytes, absmax values and double-quantization parts for any split of the input —
//! chunks that end inside a block, empty chunks, a block tail — and bad input refused with
//! the whole-tensor path's errors.

use headroom_quant::{
    AbsmaxStorage, BlockSize, QuantConfig, QuantError, QuantType, QuantizedTensor, Quantizer,
};
use headroom_tensor::Cpu;
use proptest::prelude::*;

fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut z = seed | 1;
    (0..n)
        .map(|_| {
            z ^= z << 13;
            z ^= z >> 7;
            z ^= z << 17;
            let u = (z >> 40) as f32 / (1u64 << 24) as f32;
            let scale = if z & 7 == 0 { 16.0 } else { 1.0 };
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

fn assert_same(got: &QuantizedTensor, want: &QuantizedTensor) {
    assert_eq!(got.shape(), want.shape());
    assert_eq!(got.packed(), want.packed(), "packed codes");
    let bits = |q: &QuantizedTensor| {
        q.absmax_f32()
            .iter()
            .map(|v| v.to_bits())
            .collect::<Vec<_>>()
    };
    assert_eq!(bits(got), bits(want), "absmax values");
    match (got.absmax_storage(), want.absmax_storage()) {
        (AbsmaxStorage::Plain(_), AbsmaxStorage::Plain(_)) => {}
        (AbsmaxStorage::Double(g), AbsmaxStorage::Double(w)) => {
            assert_eq!(g.codes(), w.codes(), "absmax codes");
            assert_eq!(g.offset().to_bits(), w.offset().to_bits(), "offset");
            let b = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
            assert_eq!(b(g.absmax2()), b(w.absmax2()), "nested absmax");
        }
        _ => panic!("absmax storage kinds differ"),
    }
    assert_eq!(got.stored_bytes(), want.stored_bytes());
}

/// `data` pushed in pieces ending at `cuts` (sorted, within `0..=len`).
fn streamed(
    cpu: &Cpu,
    data: &[f32],
    shape: &[usize],
    c: QuantConfig,
    cuts: &[usize],
) -> QuantizedTensor {
    let mut q = Quantizer::new(cpu, shape, c).unwrap();
    let mut at = 0;
    for &cut in cuts.iter().chain([&data.len()]) {
        q.push(&data[at..cut.max(at)]).unwrap();
        at = cut.max(at);
    }
    q.finish().unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn any_split_gives_the_whole_tensors_bytes(
        rows in 1usize..7, cols in 1usize..700, nf4: bool, bs_log2 in 6u32..10, double: bool,
        seed: u64, mut cuts in proptest::collection::vec(0.0f64..1.0, 0..6),
    ) {
        let cpu = Cpu::new();
        let n = rows * cols;
        let data = values(n, seed);
        let c = config(nf4, bs_log2, double);
        let whole = QuantizedTensor::quantize(&cpu, &data, &[rows, cols], c).unwrap();
        cuts.sort_by(f64::total_cmp);
        let cuts: Vec<usize> = cuts.iter().map(|f| (f * n as f64) as usize).collect();
        assert_same(&streamed(&cpu, &data, &[rows, cols], c, &cuts), &whole);
    }
}

#[test]
fn chunks_of_whole_rows_across_many_blocks_and_a_tail() {
    let cpu = Cpu::new();
    // 300 rows of 100: rows end inside blocks of 64, and 30 000 = 468·64 + 48 leaves a tail.
    let data = values(30_000, 7);
    for double in [false, true] {
        let c = config(true, 6, double);
        let whole = QuantizedTensor::quantize(&cpu, &data, &[300, 100], c).unwrap();
        let cuts: Vec<usize> = (1..300).map(|r| r * 100).collect();
        assert_same(&streamed(&cpu, &data, &[300, 100], c, &cuts), &whole);
        assert_same(&streamed(&cpu, &data, &[300, 100], c, &[]), &whole);
    }
}

#[test]
fn bad_input_is_refused_as_the_whole_path_refuses_it() {
    let cpu = Cpu::new();
    let c = config(true, 6, true);
    // Too many values, in one push or over several.
    let mut q = Quantizer::new(&cpu, &[2, 50], c).unwrap();
    q.push(&values(60, 1)).unwrap();
    let e = q.push(&values(41, 2)).unwrap_err();
    assert!(
        matches!(
            e,
            QuantError::LengthMismatch {
                expected: 100,
                got: 101,
                ..
            }
        ),
        "{e}"
    );
    // Refused input leaves the quantizer as it was: the right count still finishes.
    q.push(&values(40, 2)).unwrap();
    q.finish().unwrap();
    // Too few.
    let mut q = Quantizer::new(&cpu, &[2, 50], c).unwrap();
    q.push(&values(99, 1)).unwrap();
    assert!(matches!(
        q.finish(),
        Err(QuantError::LengthMismatch {
            expected: 100,
            got: 99,
            ..
        })
    ));
    // A non-finite value, its index counted from the tensor's start.
    let mut q = Quantizer::new(&cpu, &[2, 50], c).unwrap();
    q.push(&values(30, 1)).unwrap();
    let mut bad = values(10, 3);
    bad[4] = f32::NAN;
    let e = q.push(&bad).unwrap_err();
    assert!(matches!(e, QuantError::NonFinite { index: 34, .. }), "{e}");
    // An empty or overflowing shape allocates nothing.
    assert!(Quantizer::new(&cpu, &[0, 4], c).is_err());
    assert!(Quantizer::new(&cpu, &[usize::MAX, 4], c).is_err());
}
