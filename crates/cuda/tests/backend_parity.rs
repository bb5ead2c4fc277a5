//! The CUDA backend against the CPU backend and the scalar reference.
//!
//! Every check is written once, generic over `B: Backend`, and asserts against a plain scalar
//! reference; the `cpu_*` tests instantiate it for [`Cpu`] and run everywhere (proving the bodies
//! are meaningful), the `cuda_*` tests instantiate it for [`Cuda`] as well, compare the two
//! backends' outputs directly, and are ignored without a GPU.
//!
//! Comparison rules: casts are bitwise, NaN payloads included. Scale, axpy and unscale are
//! bitwise on every non-NaN result; a NaN result must be NaN on both sides (IEEE leaves NaN
//! payloads after arithmetic to the hardware: x86 propagates the input's, NVIDIA GPUs produce a
//! canonical NaN). Sum of squares is within 1e-12 relative of the sequential f64 reference and
//! bitwise identical between two runs on the same backend.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use headroom_cuda::Cuda;
use headroom_tensor::{
    bf16, f16, AllocEvent, AllocHook, AllocId, Backend, BoxedError, Cpu, DType, Error,
    MemoryCategory, Tensor,
};
use proptest::prelude::*;

const FLOATS: [DType; 3] = [DType::F32, DType::F16, DType::BF16];

/// Lengths around block (256) and grid-stride boundaries, and one past several full grids.
const EDGE_LENGTHS: [usize; 7] = [0, 1, 255, 256, 257, 4099, (1 << 20) + 3];

// ------------------------------------------------------------------------------------------
// Scalar reference on raw bits (u32 holds f32 bits, or f16/bf16 bits in the low half).

/// Widen one stored value to f32 exactly as the CPU backend does: f16 through `half` (NaN gets
/// its quiet bit), bf16 by moving the bits (a signalling NaN stays as it is).
fn ref_to_f32(dtype: DType, bits: u32) -> f32 {
    match dtype {
        DType::F32 => f32::from_bits(bits),
        DType::F16 => f16::from_bits(bits as u16).to_f32(),
        DType::BF16 => f32::from_bits(bits << 16),
        other => unreachable!("{other} is not a float"),
    }
}

/// Round an f32 to `dtype`'s bits through `half` (round to nearest even).
fn ref_from_f32(dtype: DType, v: f32) -> u32 {
    match dtype {
        DType::F32 => v.to_bits(),
        DType::F16 => f16::from_f32(v).to_bits() as u32,
        DType::BF16 => bf16::from_f32(v).to_bits() as u32,
        other => unreachable!("{other} is not a float"),
    }
}

fn is_nan_bits(dtype: DType, bits: u32) -> bool {
    ref_to_f32(dtype, bits).is_nan()
}

/// Bitwise equal, or NaN on both sides.
fn same_value(dtype: DType, got: u32, want: u32) -> bool {
    got == want || (is_nan_bits(dtype, got) && is_nan_bits(dtype, want))
}

fn assert_same_values(what: &str, dtype: DType, got: &[u32], want: &[u32]) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!(
            same_value(dtype, g, w),
            "{what}: element {i} of {}: got {g:#x}, want {w:#x}",
            got.len()
        );
    }
}

// ------------------------------------------------------------------------------------------
// Moving bits in and out of any backend.

fn upload_bits<B: Backend>(b: &B, dtype: DType, bits: &[u32]) -> B::Tensor {
    let n = bits.len();
    match dtype {
        DType::F32 => {
            let v: Vec<f32> = bits.iter().map(|&x| f32::from_bits(x)).collect();
            b.upload(&v, [n])
        }
        DType::F16 => {
            let v: Vec<f16> = bits.iter().map(|&x| f16::from_bits(x as u16)).collect();
            b.upload(&v, [n])
        }
        DType::BF16 => {
            let v: Vec<bf16> = bits.iter().map(|&x| bf16::from_bits(x as u16)).collect();
            b.upload(&v, [n])
        }
        other => unreachable!("{other} is not a float"),
    }
    .unwrap()
}

fn download_bits<B: Backend>(b: &B, t: &B::Tensor) -> Vec<u32> {
    match t.dtype() {
        DType::F32 => b
            .download::<f32>(t)
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect(),
        DType::F16 => b
            .download::<f16>(t)
            .unwrap()
            .iter()
            .map(|v| v.to_bits() as u32)
            .collect(),
        DType::BF16 => b
            .download::<bf16>(t)
            .unwrap()
            .iter()
            .map(|v| v.to_bits() as u32)
            .collect(),
        other => unreachable!("{other} is not a float"),
    }
}

/// Deterministic finite test data of any length: varied magnitudes and signs, subnormals
/// included, no two neighbours equal.
fn finite_bits(dtype: DType, len: usize, seed: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| {
            let h = (i ^ seed).wrapping_mul(0x9e37_79b9).rotate_left(13) ^ seed;
            let v =
                ((h % 20_001) as f32 - 10_000.0) * [1e-3, 1.0, 1e-7, 3.5][(h >> 28) as usize % 4];
            ref_from_f32(dtype, v)
        })
        .collect()
}

// ------------------------------------------------------------------------------------------
// Generic test bodies. Each asserts against the reference and returns what the backend
// produced, so GPU tests can also compare backends directly.

/// Cast `bits` (stored as `from`) to every float dtype, equal dtypes included (a copy).
fn check_casts<B: Backend>(b: &B, from: DType, bits: &[u32]) -> Vec<Vec<u32>> {
    let src = upload_bits(b, from, bits);
    FLOATS
        .iter()
        .map(|&to| {
            let mut dst = b.uninit([bits.len()], to).unwrap();
            b.cast(&src, &mut dst).unwrap();
            let got = download_bits(b, &dst);
            let want: Vec<u32> = if from == to {
                bits.to_vec()
            } else {
                bits.iter()
                    .map(|&x| ref_from_f32(to, ref_to_f32(from, x)))
                    .collect()
            };
            // Casts are exact bit moves and roundings: bitwise, NaN payloads included.
            assert_eq!(got.len(), want.len());
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(g, w, "cast {from}->{to} element {i} (input {:#x})", bits[i]);
            }
            got
        })
        .collect()
}

fn check_scale<B: Backend>(b: &B, dtype: DType, bits: &[u32], alpha: f32) -> Vec<u32> {
    let mut x = upload_bits(b, dtype, bits);
    b.scale(&mut x, alpha).unwrap();
    let got = download_bits(b, &x);
    let want: Vec<u32> = bits
        .iter()
        .map(|&v| ref_from_f32(dtype, ref_to_f32(dtype, v) * alpha))
        .collect();
    assert_same_values(&format!("scale {dtype} by {alpha}"), dtype, &got, &want);
    got
}

fn check_axpy<B: Backend>(
    b: &B,
    dtype: DType,
    x_bits: &[u32],
    y_bits: &[u32],
    alpha: f32,
) -> Vec<u32> {
    let x = upload_bits(b, dtype, x_bits);
    let mut y = upload_bits(b, DType::F32, y_bits);
    b.axpy(alpha, &x, &mut y).unwrap();
    let got = download_bits(b, &y);
    let want: Vec<u32> = x_bits
        .iter()
        .zip(y_bits)
        .map(|(&x, &y)| (f32::from_bits(y) + alpha * ref_to_f32(dtype, x)).to_bits())
        .collect();
    assert_same_values(
        &format!("axpy {dtype} alpha {alpha}"),
        DType::F32,
        &got,
        &want,
    );
    got
}

/// Returns the sum; asserts it against the sequential reference and that a second run gives the
/// same bits.
fn check_sum_squares<B: Backend>(b: &B, dtype: DType, bits: &[u32]) -> f64 {
    let x = upload_bits(b, dtype, bits);
    let got = b.sum_squares(&x).unwrap();
    let again = b.sum_squares(&x).unwrap();
    assert_eq!(
        got.to_bits(),
        again.to_bits(),
        "sum_squares must be deterministic"
    );
    let want: f64 = bits
        .iter()
        .map(|&v| (ref_to_f32(dtype, v) as f64).powi(2))
        .sum();
    if want.is_finite() {
        let tolerance = 1e-12 * want.abs();
        assert!(
            (got - want).abs() <= tolerance,
            "sum_squares {dtype} len {}: got {got:e}, want {want:e}",
            bits.len()
        );
    } else {
        assert_eq!(got.is_nan(), want.is_nan(), "got {got}, want {want}");
        assert_eq!(
            got.is_infinite(),
            want.is_infinite(),
            "got {got}, want {want}"
        );
    }
    got
}

/// What to plant in otherwise finite data.
#[derive(Clone, Copy, Debug)]
enum Plant {
    Inf,
    NegInf,
    NaN,
}

impl Plant {
    fn value(self) -> f32 {
        match self {
            Plant::Inf => f32::INFINITY,
            Plant::NegInf => f32::NEG_INFINITY,
            Plant::NaN => f32::NAN,
        }
    }
}

/// Unscale three tensors of different dtypes in one call, with `plant` (if any) at `index` of
/// the middle one (stored as `dtype`). Returns the flag and the middle tensor's result.
fn check_unscale<B: Backend>(
    b: &B,
    dtype: DType,
    len: usize,
    plant: Option<(usize, Plant)>,
    inv_scale: f32,
) -> (bool, Vec<u32>) {
    let mut middle = finite_bits(dtype, len, 7);
    if let Some((index, what)) = plant {
        middle[index] = ref_from_f32(dtype, what.value());
    }
    let first_bits = finite_bits(DType::F32, 300, 1);
    let last_bits = finite_bits(DType::BF16, 1000, 2);
    let mut first = upload_bits(b, DType::F32, &first_bits);
    let mut mid = upload_bits(b, dtype, &middle);
    let mut last = upload_bits(b, DType::BF16, &last_bits);
    let found = b
        .unscale_and_check(&mut [&mut first, &mut mid, &mut last], inv_scale)
        .unwrap();
    assert_eq!(
        found,
        plant.is_some(),
        "plant {plant:?} in {dtype} of length {len}"
    );
    let scaled = |dtype: DType, bits: &[u32]| -> Vec<u32> {
        bits.iter()
            .map(|&v| ref_from_f32(dtype, ref_to_f32(dtype, v) * inv_scale))
            .collect()
    };
    let got = download_bits(b, &mid);
    assert_same_values(
        "unscale (planted tensor)",
        dtype,
        &got,
        &scaled(dtype, &middle),
    );
    assert_same_values(
        "unscale (first tensor)",
        DType::F32,
        &download_bits(b, &first),
        &scaled(DType::F32, &first_bits),
    );
    assert_same_values(
        "unscale (last tensor)",
        DType::BF16,
        &download_bits(b, &last),
        &scaled(DType::BF16, &last_bits),
    );
    (found, got)
}

/// Bad arguments give the same typed errors as the CPU, and leave data unchanged.
fn check_errors<B: Backend>(b: &B) {
    let x = b.upload(&[1.0f32, 2.0, 3.0], [3]).unwrap();
    assert!(matches!(
        b.upload(&[1.0f32; 2], [3]),
        Err(Error::LengthMismatch { .. })
    ));

    let mut short = b.zeros([2], DType::F16).unwrap();
    assert!(matches!(
        b.cast(&x, &mut short),
        Err(Error::LengthMismatch { .. })
    ));
    let bytes = b.upload(&[1u8, 2, 3], [3]).unwrap();
    let mut f = b.zeros([3], DType::F32).unwrap();
    assert!(matches!(
        b.cast(&bytes, &mut f),
        Err(Error::UnsupportedDType {
            op: "cast",
            dtype: DType::U8
        })
    ));
    let mut h = b.zeros([3], DType::F16).unwrap();
    assert!(matches!(
        b.copy(&x, &mut h),
        Err(Error::DTypeMismatch { op: "copy", .. })
    ));

    let mut y16 = b.zeros([3], DType::F16).unwrap();
    assert!(matches!(
        b.axpy(1.0, &x, &mut y16),
        Err(Error::DTypeMismatch {
            op: "axpy (y)",
            expected: DType::F32,
            got: DType::F16
        })
    ));
    let ints = b.upload(&[1i32, 2, 3], [3]).unwrap();
    let mut y = b.zeros([3], DType::F32).unwrap();
    assert!(matches!(
        b.axpy(1.0, &ints, &mut y),
        Err(Error::UnsupportedDType { .. })
    ));
    let mut y4 = b.zeros([4], DType::F32).unwrap();
    assert!(matches!(
        b.axpy(1.0, &x, &mut y4),
        Err(Error::LengthMismatch { .. })
    ));

    let mut u16s = b.upload(&[1u16, 2], [2]).unwrap();
    assert!(matches!(
        b.scale(&mut u16s, 2.0),
        Err(Error::UnsupportedDType { .. })
    ));
    let longs = b.upload(&[1i64], [1]).unwrap();
    assert!(matches!(
        b.sum_squares(&longs),
        Err(Error::UnsupportedDType { .. })
    ));

    // One bad tensor: an error, and the good one before it is untouched.
    let mut good = b.upload(&[4.0f32, 8.0], [2]).unwrap();
    let mut bad = b.upload(&[1u32, 2], [2]).unwrap();
    assert!(matches!(
        b.unscale_and_check(&mut [&mut good, &mut bad], 0.5),
        Err(Error::UnsupportedDType { .. })
    ));
    assert_eq!(b.download::<f32>(&good).unwrap(), [4.0, 8.0]);

    assert!(matches!(
        b.download::<f16>(&x),
        Err(Error::DTypeMismatch { .. })
    ));
    let mut two = [0f32; 2];
    assert!(matches!(
        b.download_into(&x, &mut two),
        Err(Error::LengthMismatch { .. })
    ));

    let mut m = b
        .upload(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3])
        .unwrap();
    assert!(matches!(
        m.reshape([4].into()),
        Err(Error::InvalidShape { .. })
    ));
    m.reshape([3, 2].into()).unwrap();
    assert_eq!(m.shape().dims(), [3, 2]);
    assert_eq!(
        b.download::<f32>(&m).unwrap(),
        [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]
    );

    // Valid calls still work after all that.
    let mut copy = b.uninit([3], DType::F32).unwrap();
    b.copy(&x, &mut copy).unwrap();
    assert_eq!(b.download::<f32>(&copy).unwrap(), [1.0, 2.0, 3.0]);
    let z = b.zeros([2, 2], DType::BF16).unwrap();
    assert_eq!(b.download::<bf16>(&z).unwrap(), [bf16::ZERO; 4]);
    assert_eq!(
        (z.numel(), z.size_in_bytes(), z.device()),
        (4, 8, b.device())
    );
    b.synchronize().unwrap();
}

/// Empty tensors go through every primitive.
fn check_empty<B: Backend>(b: &B) {
    for dtype in FLOATS {
        let mut e = b.zeros([0], dtype).unwrap();
        assert_eq!(e.size_in_bytes(), 0);
        assert_eq!(download_bits(b, &e), Vec::<u32>::new());
        b.scale(&mut e, 3.0).unwrap();
        // By value: the CPU returns -0.0 here (Rust's float `Sum` starts from -0.0), CUDA +0.0.
        assert_eq!(b.sum_squares(&e).unwrap(), 0.0);
        assert!(!b.unscale_and_check(&mut [&mut e], 0.5).unwrap());
        for to in FLOATS {
            let mut d = b.zeros([0, 5], to).unwrap();
            b.cast(&e, &mut d).unwrap();
        }
        let mut y = b.zeros([0], DType::F32).unwrap();
        b.axpy(2.0, &e, &mut y).unwrap();
    }
    assert!(!b.unscale_and_check(&mut [], 0.5).unwrap());
}

/// Records every event; refuses allocations above a budget.
#[derive(Default)]
struct RecordingHook {
    events: Mutex<Vec<(bool, AllocEvent)>>,
    refuse_above: Mutex<Option<usize>>,
}

impl AllocHook for RecordingHook {
    fn on_alloc(&self, e: &AllocEvent) -> Result<(), BoxedError> {
        if self
            .refuse_above
            .lock()
            .unwrap()
            .is_some_and(|max| e.bytes > max)
        {
            return Err("over budget".into());
        }
        self.events.lock().unwrap().push((true, *e));
        Ok(())
    }
    fn on_free(&self, e: &AllocEvent) {
        self.events.lock().unwrap().push((false, *e));
    }
}

impl RecordingHook {
    fn take(&self) -> Vec<(bool, AllocEvent)> {
        std::mem::take(&mut *self.events.lock().unwrap())
    }
}

/// Every allocation a backend makes is reported, tagged and freed exactly once. Returns the
/// workspace events seen during `sum_squares` and `unscale_and_check`.
fn check_alloc_hook<B: Backend>(make: impl FnOnce(Arc<dyn AllocHook>) -> B) -> Vec<AllocEvent> {
    let hook = Arc::new(RecordingHook::default());
    let b = make(hook.clone());
    assert!(b.alloc_hook().is_some());
    {
        let _g = MemoryCategory::Gradients.enter();
        let t = b.zeros([10, 100], DType::F32).unwrap();
        let events = hook.take();
        assert_eq!(events.len(), 1);
        let (alloc, e) = events[0];
        assert!(alloc);
        assert_eq!((e.bytes, e.dtype, e.device), (4000, DType::F32, b.device()));
        assert_eq!(e.category, MemoryCategory::Gradients);
        drop(t);
        assert_eq!(hook.take(), vec![(false, e)]);
    }
    {
        let _a = MemoryCategory::Activations.enter();
        let x = b.upload(&[bf16::ONE; 3], [3]).unwrap();
        let mut y = b.uninit([3], DType::F32).unwrap();
        b.cast(&x, &mut y).unwrap();
        let events = hook.take();
        assert_eq!(events.len(), 2, "{events:?}");
        assert!(events
            .iter()
            .all(|(a, e)| *a && e.category == MemoryCategory::Activations));
        assert_eq!(events[0].1.bytes, 6);
        assert_eq!(events[1].1.bytes, 12);
    }
    assert_eq!(hook.take().len(), 2, "both tensors freed on scope exit");

    // Operations: anything they allocate must be freed by the time they return.
    let mut x = b.upload(&[1.0f32, f32::NAN, 3.0], [3]).unwrap();
    hook.take();
    b.sum_squares(&x).unwrap();
    assert!(b.unscale_and_check(&mut [&mut x], 0.5).unwrap());
    let events = hook.take();
    let mut live: HashMap<AllocId, usize> = HashMap::new();
    for (alloc, e) in &events {
        assert_eq!(e.device, b.device());
        assert_eq!(
            e.category,
            MemoryCategory::Workspace,
            "op scratch is workspace: {e:?}"
        );
        if *alloc {
            assert!(live.insert(e.id, e.bytes).is_none());
        } else {
            assert_eq!(
                live.remove(&e.id),
                Some(e.bytes),
                "free without alloc: {e:?}"
            );
        }
    }
    assert!(live.is_empty(), "workspace leaked: {live:?}");

    // A refused allocation is a typed error and reports nothing.
    *hook.refuse_above.lock().unwrap() = Some(100);
    assert!(matches!(
        b.zeros([1000], DType::F32),
        Err(Error::AllocationRejected { bytes: 4000, .. })
    ));
    assert!(hook.take().is_empty());
    *hook.refuse_above.lock().unwrap() = None;
    drop(x);
    assert_eq!(hook.take().len(), 1);
    events
        .into_iter()
        .filter(|(a, _)| *a)
        .map(|(_, e)| e)
        .collect()
}

/// A sum over several full grids of the GPU's first pass: same bits on five runs, and within
/// tolerance of the sequential reference.
fn check_large_sum_squares<B: Backend>(b: &B) -> f64 {
    let bits = finite_bits(DType::F32, 3 << 20, 11);
    let first = check_sum_squares(b, DType::F32, &bits);
    let x = upload_bits(b, DType::F32, &bits);
    for _ in 0..4 {
        assert_eq!(b.sum_squares(&x).unwrap().to_bits(), first.to_bits());
    }
    first
}

// ------------------------------------------------------------------------------------------
// Strategies.

/// f32 bit patterns with the special classes over-represented.
fn f32_bits() -> impl Strategy<Value = u32> {
    prop_oneof![
        3 => any::<u32>(),
        1 => prop::sample::select(vec![
            0u32, 0x8000_0000, 0x7f80_0000, 0xff80_0000, 0x7fc0_0000, 0xffc0_0001, 0x7f80_0001,
            0x0000_0001, 0x807f_ffff, 0x7f7f_ffff, 0x3380_0000, 0x3380_0001, 0x477f_f000,
            0x477f_efff, 0x3f80_8000, 0x3f81_8000, 0x0080_0000,
        ]),
    ]
}

/// Bits for `dtype` (16-bit types: the whole u16 range covers every class often enough).
fn bits_for(dtype: DType, len: std::ops::Range<usize>) -> BoxedStrategy<Vec<u32>> {
    match dtype {
        DType::F32 => prop::collection::vec(f32_bits(), len).boxed(),
        _ => prop::collection::vec(any::<u16>().prop_map(u32::from), len).boxed(),
    }
}

fn dtype_and_bits(len: std::ops::Range<usize>) -> impl Strategy<Value = (DType, Vec<u32>)> {
    prop::sample::select(FLOATS.to_vec())
        .prop_flat_map(move |d| (Just(d), bits_for(d, len.clone())))
}

fn finite(dtype: DType, bits: Vec<u32>) -> Vec<u32> {
    bits.into_iter()
        .map(|b| {
            if ref_to_f32(dtype, b).is_finite() {
                b
            } else {
                0
            }
        })
        .collect()
}

fn plant_strategy() -> impl Strategy<Value = Plant> {
    prop::sample::select(vec![Plant::Inf, Plant::NegInf, Plant::NaN])
}

// ------------------------------------------------------------------------------------------
// CPU instantiations: run everywhere.

#[test]
fn cpu_edge_lengths() {
    let cpu = Cpu::new();
    for len in EDGE_LENGTHS {
        for dtype in FLOATS {
            let bits = finite_bits(dtype, len, len as u32);
            check_casts(&cpu, dtype, &bits);
            check_scale(&cpu, dtype, &bits, 0.375);
            check_axpy(&cpu, dtype, &bits, &finite_bits(DType::F32, len, 3), -1.5);
            check_sum_squares(&cpu, dtype, &bits);
            if len > 0 {
                check_unscale(&cpu, dtype, len, Some((len - 1, Plant::NaN)), 1.0 / 1024.0);
            }
            check_unscale(&cpu, dtype, len, None, 1.0 / 1024.0);
        }
    }
}

/// `fill_zero` clears every element to +0 bits, non-finite ones included, for every dtype.
fn check_fill_zero<B: Backend>(b: &B) {
    for dtype in DType::ALL {
        for len in [0usize, 1, 257, 70_001] {
            let bytes: Vec<u8> = (0..len * dtype.size_in_bytes())
                .map(|i| (i % 251) as u8 | 0x80)
                .collect();
            // The high bit set in every byte makes many float elements inf or NaN.
            let mut t = upload_raw(b, dtype, &bytes);
            b.fill_zero(&mut t).unwrap();
            let back = download_raw(b, &t);
            assert!(back.iter().all(|&x| x == 0), "{dtype} len {len}");
        }
    }
}

fn upload_raw<B: Backend>(b: &B, dtype: DType, bytes: &[u8]) -> B::Tensor {
    use headroom_tensor::{bf16, f16};
    let n = bytes.len() / dtype.size_in_bytes();
    match dtype {
        DType::F32 => b.upload::<f32>(bytemuck::cast_slice(&aligned::<u32>(bytes)), [n]),
        DType::F16 => b.upload::<f16>(bytemuck::cast_slice(&aligned::<u16>(bytes)), [n]),
        DType::BF16 => b.upload::<bf16>(bytemuck::cast_slice(&aligned::<u16>(bytes)), [n]),
        DType::U16 => b.upload::<u16>(&aligned::<u16>(bytes), [n]),
        DType::U32 => b.upload::<u32>(&aligned::<u32>(bytes), [n]),
        DType::I32 => b.upload::<i32>(bytemuck::cast_slice(&aligned::<u32>(bytes)), [n]),
        DType::I64 => b.upload::<i64>(bytemuck::cast_slice(&aligned::<u64>(bytes)), [n]),
        _ => b.upload::<u8>(bytes, [n]),
    }
    .unwrap()
}

fn aligned<T: bytemuck::Pod>(bytes: &[u8]) -> Vec<T> {
    let mut v = vec![T::zeroed(); bytes.len() / std::mem::size_of::<T>()];
    bytemuck::cast_slice_mut::<T, u8>(&mut v).copy_from_slice(bytes);
    v
}

fn download_raw<B: Backend>(b: &B, t: &B::Tensor) -> Vec<u8> {
    use headroom_tensor::{bf16, f16};
    match t.dtype() {
        DType::F32 => bytemuck::cast_slice(&b.download::<f32>(t).unwrap()).to_vec(),
        DType::F16 => bytemuck::cast_slice(&b.download::<f16>(t).unwrap()).to_vec(),
        DType::BF16 => bytemuck::cast_slice(&b.download::<bf16>(t).unwrap()).to_vec(),
        DType::U16 => bytemuck::cast_slice(&b.download::<u16>(t).unwrap()).to_vec(),
        DType::U32 => bytemuck::cast_slice(&b.download::<u32>(t).unwrap()).to_vec(),
        DType::I32 => bytemuck::cast_slice(&b.download::<i32>(t).unwrap()).to_vec(),
        DType::I64 => bytemuck::cast_slice(&b.download::<i64>(t).unwrap()).to_vec(),
        _ => b.download::<u8>(t).unwrap(),
    }
}

#[test]
fn cpu_fill_zero() {
    check_fill_zero(&Cpu::new());
}

#[test]
fn cpu_large_sum_squares() {
    check_large_sum_squares(&Cpu::new());
}

#[test]
fn cpu_errors_and_empty() {
    check_errors(&Cpu::new());
    check_empty(&Cpu::new());
}

#[test]
fn cpu_alloc_hook() {
    let workspace = check_alloc_hook(|h| Cpu::new().with_alloc_hook(h));
    assert!(workspace.is_empty(), "the CPU needs no scratch memory");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn cpu_casts((dtype, bits) in dtype_and_bits(0..700)) {
        check_casts(&Cpu::new(), dtype, &bits);
    }

    #[test]
    fn cpu_scale_and_axpy((dtype, bits) in dtype_and_bits(0..700), alpha in any::<f32>(), seed in any::<u32>()) {
        check_scale(&Cpu::new(), dtype, &bits, alpha);
        let y = finite_bits(DType::F32, bits.len(), seed);
        check_axpy(&Cpu::new(), dtype, &bits, &y, alpha);
    }

    #[test]
    fn cpu_sum_squares((dtype, bits) in dtype_and_bits(0..3000)) {
        check_sum_squares(&Cpu::new(), dtype, &finite(dtype, bits));
    }

    #[test]
    fn cpu_unscale_finds_a_plant_anywhere(
        dtype in prop::sample::select(FLOATS.to_vec()),
        (len, index) in (1usize..3000).prop_flat_map(|n| (Just(n), 0..n)),
        what in plant_strategy(),
    ) {
        check_unscale(&Cpu::new(), dtype, len, Some((index, what)), 0.125);
        check_unscale(&Cpu::new(), dtype, len, None, 0.125);
    }
}

// ------------------------------------------------------------------------------------------
// CUDA instantiations: the same bodies on the GPU, plus direct comparison with the CPU.

fn cuda() -> &'static Cuda {
    static CUDA: OnceLock<Cuda> = OnceLock::new();
    CUDA.get_or_init(|| Cuda::new(0).expect("this test needs a CUDA device"))
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_reports_its_device() {
    let c = cuda();
    assert!(!c.device_name().is_empty());
    assert!(c.compute_capability().0 >= 5);
    assert_eq!(c.arch(), headroom_cuda::arch_for(c.compute_capability()));
    let (free, total) = c.mem_info().unwrap();
    assert!(free <= total && total > 0);
    assert!(c.driver_version() >= 12000);
    // Every module compiles for this device and its CUBIN loads under this driver.
    c.load_all_kernels().unwrap();
    eprintln!(
        "{} sm_{:?}, driver {}, {free}/{total} B free",
        c.device_name(),
        c.compute_capability(),
        c.driver_version()
    );
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_edge_lengths_match_cpu() {
    let (cpu, gpu) = (Cpu::new(), cuda());
    for len in EDGE_LENGTHS {
        for dtype in FLOATS {
            let bits = finite_bits(dtype, len, len as u32);
            assert_eq!(
                check_casts(gpu, dtype, &bits),
                check_casts(&cpu, dtype, &bits)
            );
            assert_same_values(
                "scale gpu vs cpu",
                dtype,
                &check_scale(gpu, dtype, &bits, 0.375),
                &check_scale(&cpu, dtype, &bits, 0.375),
            );
            let y = finite_bits(DType::F32, len, 3);
            assert_same_values(
                "axpy gpu vs cpu",
                DType::F32,
                &check_axpy(gpu, dtype, &bits, &y, -1.5),
                &check_axpy(&cpu, dtype, &bits, &y, -1.5),
            );
            let (g, c) = (
                check_sum_squares(gpu, dtype, &bits),
                check_sum_squares(&cpu, dtype, &bits),
            );
            assert!(
                (g - c).abs() <= 1e-12 * c.abs(),
                "sum_squares gpu {g:e} cpu {c:e}"
            );
            for plant in [
                None,
                Some((0, Plant::Inf)),
                Some((len.saturating_sub(1), Plant::NaN)),
            ] {
                if len == 0 && plant.is_some() {
                    continue;
                }
                let (gf, gv) = check_unscale(gpu, dtype, len, plant, 1.0 / 1024.0);
                let (cf, cv) = check_unscale(&cpu, dtype, len, plant, 1.0 / 1024.0);
                assert_eq!(gf, cf);
                assert_same_values("unscale gpu vs cpu", dtype, &gv, &cv);
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_casts_every_16_bit_pattern_like_cpu() {
    let (cpu, gpu) = (Cpu::new(), cuda());
    let all: Vec<u32> = (0..=u16::MAX as u32).collect();
    for dtype in [DType::F16, DType::BF16] {
        assert_eq!(
            check_casts(gpu, dtype, &all),
            check_casts(&cpu, dtype, &all)
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_sum_squares_is_deterministic_and_close_to_cpu_on_large_input() {
    let g = check_large_sum_squares(cuda());
    let c = check_large_sum_squares(&Cpu::new());
    assert!((g - c).abs() <= 1e-12 * c, "gpu {g:e} cpu {c:e}");
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_fill_zero() {
    check_fill_zero(cuda());
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_errors_and_empty() {
    check_errors(cuda());
    check_empty(cuda());
}

#[test]
#[ignore = "needs a CUDA device"]
fn cuda_alloc_hook_sees_device_allocations() {
    let workspace = check_alloc_hook(|h| cuda().clone().with_alloc_hook(h));
    // sum_squares' partials and unscale's flag, both on the device.
    assert_eq!(workspace.len(), 2, "{workspace:?}");
    let partials = (headroom_kernels::SUM_SQUARES_BLOCKS as usize + 1) * 8;
    assert_eq!(workspace[0].bytes, partials);
    assert_eq!((workspace[1].bytes, workspace[1].dtype), (4, DType::I32));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    #[ignore = "needs a CUDA device"]
    fn cuda_casts_match_cpu((dtype, bits) in dtype_and_bits(0..5000)) {
        prop_assert_eq!(check_casts(cuda(), dtype, &bits), check_casts(&Cpu::new(), dtype, &bits));
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn cuda_scale_and_axpy_match_cpu((dtype, bits) in dtype_and_bits(0..5000), alpha in any::<f32>(), seed in any::<u32>()) {
        let cpu = Cpu::new();
        assert_same_values("scale", dtype, &check_scale(cuda(), dtype, &bits, alpha), &check_scale(&cpu, dtype, &bits, alpha));
        let y = finite_bits(DType::F32, bits.len(), seed);
        assert_same_values("axpy", DType::F32, &check_axpy(cuda(), dtype, &bits, &y, alpha), &check_axpy(&cpu, dtype, &bits, &y, alpha));
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn cuda_sum_squares_matches_cpu((dtype, bits) in dtype_and_bits(0..20_000)) {
        let bits = finite(dtype, bits);
        let g = check_sum_squares(cuda(), dtype, &bits);
        let c = check_sum_squares(&Cpu::new(), dtype, &bits);
        prop_assert!((g - c).abs() <= 1e-12 * c.abs(), "gpu {:e} cpu {:e}", g, c);
    }

    #[test]
    #[ignore = "needs a CUDA device"]
    fn cuda_unscale_finds_a_plant_anywhere(
        dtype in prop::sample::select(FLOATS.to_vec()),
        (len, index) in (1usize..20_000).prop_flat_map(|n| (Just(n), 0..n)),
        what in plant_strategy(),
    ) {
        let (gf, gv) = check_unscale(cuda(), dtype, len, Some((index, what)), 0.125);
        let (cf, cv) = check_unscale(&Cpu::new(), dtype, len, Some((index, what)), 0.125);
        prop_assert_eq!(gf, cf);
        assert_same_values("unscale", dtype, &gv, &cv);
        prop_assert!(!check_unscale(cuda(), dtype, len, None, 0.125).0);
    }
}
