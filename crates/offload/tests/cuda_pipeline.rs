//! The CUDA offload pipeline on a real device. Every test needs a GPU and is ignored otherwise;
//! run them with `cargo test -p headroom-offload --features cuda -- --include-ignored` (or
//! through `cargo xtask device-bundle`). Each takes seconds.
//!
//! Tolerance: none. The pipeline runs the same `CpuAdamW` on the same gradient bytes, so the
//! device parameters and the f32 masters must equal the serial reference bit for bit.
#![cfg(feature = "cuda")]

use std::sync::{Arc, Mutex};

use headroom_cuda::{Cuda, CudaTensor};
use headroom_offload::{
    AdamWHyper, CpuAdamW, CudaOffloadPipeline, DeviceParamSpec, OffloadError, ParamSpec,
    StagingPlan, StatePrecision, StoreSpec,
};
use headroom_tensor::cpu::kernels::{FloatSlice, FloatSliceMut};
use headroom_tensor::{
    bf16, f16, AllocEvent, AllocHook, Backend, BoxedError, Cpu, DType, Device, MemoryCategory,
    Tensor,
};

/// Element counts: a tail that is no multiple of any vector width, a single element, an empty
/// tensor, and tensors large enough that copies take real time.
const NUMELS: [usize; 6] = [3001, 1, 0, 70_000, 257, 262_144];
const STEPS: usize = 3;

fn device() -> Cuda {
    Cuda::new(0).expect("this test needs a CUDA device")
}

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

fn optimizer(cpu: &Cpu) -> CpuAdamW {
    let params: Vec<ParamSpec> = NUMELS
        .iter()
        .map(|&numel| ParamSpec { numel, group: 0 })
        .collect();
    let hyper = AdamWHyper {
        lr: 2e-3,
        weight_decay: 0.1,
        ..AdamWHyper::default()
    };
    CpuAdamW::new(
        vec![hyper],
        &params,
        StatePrecision::F32,
        StoreSpec::Ram(cpu),
    )
    .unwrap()
}

/// Upload f32 values as a device tensor of `dtype` (rounded on the host).
fn upload_as(cuda: &Cuda, values: &[f32], dtype: DType) -> CudaTensor {
    let n = values.len();
    match dtype {
        DType::F32 => cuda.upload(values, [n]),
        DType::BF16 => cuda.upload(
            &values
                .iter()
                .map(|&x| bf16::from_f32(x))
                .collect::<Vec<_>>(),
            [n],
        ),
        DType::F16 => cuda.upload(
            &values.iter().map(|&x| f16::from_f32(x)).collect::<Vec<_>>(),
            [n],
        ),
        other => panic!("{other:?}"),
    }
    .unwrap()
}

/// A device tensor's raw bytes.
fn download_bytes(cuda: &Cuda, t: &CudaTensor) -> Vec<u8> {
    match t.dtype() {
        DType::F32 => bytemuck::cast_slice(&cuda.download::<f32>(t).unwrap()).to_vec(),
        DType::BF16 => bytemuck::cast_slice(&cuda.download::<bf16>(t).unwrap()).to_vec(),
        DType::F16 => bytemuck::cast_slice(&cuda.download::<f16>(t).unwrap()).to_vec(),
        other => panic!("{other:?}"),
    }
}

/// `x` rounded to `dtype` and back, so a master starts equal to its device copy.
fn representable(x: f32, dtype: DType) -> f32 {
    match dtype {
        DType::BF16 => bf16::from_f32(x).to_f32(),
        DType::F16 => f16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// Queue a few milliseconds of unrelated work on the compute stream, so that a copy that did
/// not wait for backward would read stale gradients and the comparison would fail.
fn busy_backward(cuda: &Cuda, scratch: &mut CudaTensor) {
    for _ in 0..50 {
        cuda.scale(scratch, 1.0).unwrap();
    }
}

/// Several steps through the pipeline against serial `CpuAdamW::step` on the gradients
/// downloaded from the device, with gradients in `grad_dtype` and device parameters (the
/// working copy) in `param_dtype`. Without `cudarc_tracking`, cudarc's own per-buffer events
/// are off, so only the pipeline's events order the copies against backward and forward.
fn pipeline_matches_serial(grad_dtype: DType, param_dtype: DType, cudarc_tracking: bool) {
    let cuda = device();
    if !cudarc_tracking {
        // SAFETY: called before this context allocates anything; every tensor below is used on
        // the backend's one stream, and the pipeline orders its copy streams with its own
        // events, which is what this test checks.
        unsafe { cuda.context().disable_event_tracking() };
    }
    let cpu = Cpu::new();
    let specs: Vec<DeviceParamSpec> = NUMELS
        .iter()
        .map(|&numel| DeviceParamSpec {
            numel,
            grad_dtype,
            param_dtype,
        })
        .collect();
    // Backward finishes the last parameter first; ~64 KiB buckets give several buckets.
    let backward_order: Vec<usize> = (0..NUMELS.len()).rev().collect();
    let plan = StagingPlan::by_size(specs, &backward_order, 64 << 10).unwrap();
    assert!(plan.num_buckets() >= 3, "{}", plan.num_buckets());

    let masters0: Vec<Vec<f32>> = NUMELS
        .iter()
        .enumerate()
        .map(|(p, &n)| {
            data(p as u64 + 1, n, 1.0)
                .into_iter()
                .map(|x| representable(x, param_dtype))
                .collect()
        })
        .collect();
    let mut params: Vec<CudaTensor> = masters0
        .iter()
        .map(|m| upload_as(&cuda, m, param_dtype))
        .collect();
    let mut grads: Vec<CudaTensor> = NUMELS
        .iter()
        .map(|&n| cuda.zeros([n], grad_dtype).unwrap())
        .collect();
    let mut scratch = cuda.zeros([1 << 24], DType::F32).unwrap();

    let mut reference = optimizer(&cpu);
    let mut ref_masters = masters0.clone();
    let mut pipe =
        CudaOffloadPipeline::new(&cuda, optimizer(&cpu), masters0, plan.clone()).unwrap();

    for step in 0..STEPS {
        if step == 1 {
            // A learning-rate schedule, between steps.
            reference.set_lr(0, 5e-3).unwrap();
            pipe.set_lr(0, 5e-3).unwrap();
        }
        // "Backward": for each bucket in order, busy work, then its gradients are written on
        // the compute stream, then the bucket is handed over.
        for (b, layout) in plan.buckets().iter().enumerate() {
            // Uploads from pageable memory synchronise the stream, so they come first; the
            // gradients are then written by device-side copies queued behind the busy work,
            // still pending when the bucket is handed over.
            let fresh: Vec<(usize, CudaTensor)> = layout
                .params
                .iter()
                .map(|staged| {
                    let p = staged.param;
                    let g = data(1000 * step as u64 + p as u64 + 77, NUMELS[p], 0.05);
                    (p, upload_as(&cuda, &g, grad_dtype))
                })
                .collect();
            busy_backward(&cuda, &mut scratch);
            for (p, g) in &fresh {
                cuda.copy(g, &mut grads[*p]).unwrap();
            }
            pipe.hand_bucket(b, &mut params, &grads).unwrap();
        }
        pipe.finish(&mut params).unwrap();

        // Reference: serial updates on the gradients as the device holds them.
        for p in 0..NUMELS.len() {
            // Typed downloads: a `Vec<u8>` need not be aligned for f32 or bf16 (on the first
            // GPU machine it was not, and `cast_slice` panicked).
            let (g_f32, g_bf16, g_f16);
            let g = match grad_dtype {
                DType::F32 => {
                    g_f32 = cuda.download::<f32>(&grads[p]).unwrap();
                    FloatSlice::F32(&g_f32)
                }
                DType::BF16 => {
                    g_bf16 = cuda.download::<bf16>(&grads[p]).unwrap();
                    FloatSlice::BF16(&g_bf16)
                }
                _ => {
                    g_f16 = cuda.download::<f16>(&grads[p]).unwrap();
                    FloatSlice::F16(&g_f16)
                }
            };
            let mut copy = vec![0u8; NUMELS[p] * param_dtype.size_in_bytes()];
            // `u8` storage may be misaligned for f32/bf16: go through typed vectors.
            match param_dtype {
                DType::F32 => {
                    let mut c = vec![0f32; NUMELS[p]];
                    reference
                        .step(p, &mut ref_masters[p], g, Some(FloatSliceMut::F32(&mut c)))
                        .unwrap();
                    copy.copy_from_slice(bytemuck::cast_slice(&c));
                }
                DType::BF16 => {
                    let mut c = vec![bf16::ZERO; NUMELS[p]];
                    reference
                        .step(p, &mut ref_masters[p], g, Some(FloatSliceMut::BF16(&mut c)))
                        .unwrap();
                    copy.copy_from_slice(bytemuck::cast_slice(&c));
                }
                _ => {
                    let mut c = vec![f16::ZERO; NUMELS[p]];
                    reference
                        .step(p, &mut ref_masters[p], g, Some(FloatSliceMut::F16(&mut c)))
                        .unwrap();
                    copy.copy_from_slice(bytemuck::cast_slice(&c));
                }
            }
            // Downloads run on the compute stream, which `finish` made wait for the uploads.
            assert_eq!(
                download_bytes(&cuda, &params[p]),
                copy,
                "step {step}, parameter {p}"
            );
        }
    }
    let (opt, masters) = pipe.shutdown().unwrap();
    for (p, (a, b)) in masters.iter().zip(&ref_masters).enumerate() {
        assert_eq!(
            bytemuck::cast_slice::<f32, u32>(a),
            bytemuck::cast_slice::<f32, u32>(b),
            "master {p}"
        );
    }
    assert_eq!(opt.moments(), reference.moments());
    assert_eq!(opt.state(), reference.state());
}

#[test]
#[ignore = "needs a CUDA device"]
fn f32_gradients_and_parameters_equal_serial_adamw_bitwise() {
    pipeline_matches_serial(DType::F32, DType::F32, true);
}

#[test]
#[ignore = "needs a CUDA device"]
fn bf16_gradients_and_working_copy_equal_serial_adamw_bitwise() {
    pipeline_matches_serial(DType::BF16, DType::BF16, true);
}

#[test]
#[ignore = "needs a CUDA device"]
fn ordering_holds_by_the_pipelines_own_events_without_cudarc_tracking() {
    pipeline_matches_serial(DType::BF16, DType::BF16, false);
}

#[test]
#[ignore = "needs a CUDA device"]
fn f16_gradients_with_f32_parameters_equal_serial_adamw_bitwise() {
    pipeline_matches_serial(DType::F16, DType::F32, true);
}

/// Records every allocation event.
#[derive(Default)]
struct Ledger(Mutex<Vec<(bool, AllocEvent)>>);

impl AllocHook for Ledger {
    fn on_alloc(&self, e: &AllocEvent) -> Result<(), BoxedError> {
        self.0.lock().unwrap().push((true, *e));
        Ok(())
    }
    fn on_free(&self, e: &AllocEvent) {
        self.0.lock().unwrap().push((false, *e));
    }
}

fn small_setup(
    cuda: &Cuda,
    cpu: &Cpu,
) -> (
    CudaOffloadPipeline,
    Vec<CudaTensor>,
    Vec<CudaTensor>,
    StagingPlan,
) {
    let specs: Vec<DeviceParamSpec> = NUMELS
        .iter()
        .map(|&numel| DeviceParamSpec {
            numel,
            grad_dtype: DType::BF16,
            param_dtype: DType::BF16,
        })
        .collect();
    let order: Vec<usize> = (0..NUMELS.len()).rev().collect();
    let plan = StagingPlan::by_size(specs, &order, 64 << 10).unwrap();
    let masters: Vec<Vec<f32>> = NUMELS.iter().map(|&n| vec![0.0; n]).collect();
    let params: Vec<CudaTensor> = NUMELS
        .iter()
        .map(|&n| cuda.zeros([n], DType::BF16).unwrap())
        .collect();
    let grads: Vec<CudaTensor> = NUMELS
        .iter()
        .map(|&n| cuda.zeros([n], DType::BF16).unwrap())
        .collect();
    let pipe = CudaOffloadPipeline::new(cuda, optimizer(cpu), masters, plan.clone()).unwrap();
    (pipe, params, grads, plan)
}

#[test]
#[ignore = "needs a CUDA device"]
fn staging_buffers_are_ordinary_pinned_memory_not_write_combined() {
    let cuda = device();
    let cpu = Cpu::new();
    let (pipe, _params, _grads, plan) = small_setup(&cuda, &cpu);
    let flags = pipe.pinned_host_alloc_flags().unwrap();
    // Every bucket has non-empty gradient and upload buffers.
    assert_eq!(flags.len(), 2 * plan.num_buckets());
    for f in flags {
        assert_eq!(
            f & headroom_cuda::cudarc::driver::sys::CU_MEMHOSTALLOC_WRITECOMBINED,
            0,
            "flags {f:#x}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA device"]
fn staging_is_on_the_host_ledger_once_and_steps_allocate_nothing() {
    let ledger = Arc::new(Ledger::default());
    let cuda = device().with_alloc_hook(ledger.clone());
    let cpu = Cpu::new();
    let (mut pipe, mut params, grads, plan) = small_setup(&cuda, &cpu);
    let host_bytes = |category| {
        ledger
            .0
            .lock()
            .unwrap()
            .iter()
            .filter(|(alloc, e)| *alloc && e.device == Device::Cpu && e.category == category)
            .map(|(_, e)| e.bytes)
            .sum::<usize>()
    };
    assert_eq!(
        host_bytes(MemoryCategory::Gradients),
        plan.total_grad_staging_bytes()
    );
    assert_eq!(
        host_bytes(MemoryCategory::Parameters),
        plan.total_upload_staging_bytes()
    );
    let events_before = ledger.0.lock().unwrap().len();
    for _ in 0..3 {
        for b in 0..plan.num_buckets() {
            pipe.hand_bucket(b, &mut params, &grads).unwrap();
        }
        pipe.finish(&mut params).unwrap();
    }
    assert_eq!(
        ledger.0.lock().unwrap().len(),
        events_before,
        "a step allocated memory"
    );
    drop(pipe);
    // Every staging buffer was freed and reported.
    let frees = ledger
        .0
        .lock()
        .unwrap()
        .iter()
        .filter(|(alloc, e)| !*alloc && e.device == Device::Cpu)
        .count();
    assert_eq!(frees, 2 * plan.num_buckets());
}

#[test]
#[ignore = "needs a CUDA device"]
fn misuse_gets_typed_errors_and_loses_nothing() {
    let cuda = device();
    let cpu = Cpu::new();
    let (mut pipe, mut params, grads, plan) = small_setup(&cuda, &cpu);
    assert!(matches!(
        pipe.hand_bucket(plan.num_buckets(), &mut params, &grads),
        Err(OffloadError::UnknownBucket { .. })
    ));
    // A gradient of the wrong dtype: rejected before anything is queued.
    let p0 = plan.buckets()[0].params[0].param;
    let mut wrong = grads
        .iter()
        .map(|g| cuda.zeros(g.shape().clone(), DType::BF16).unwrap())
        .collect::<Vec<_>>();
    wrong[p0] = cuda.zeros([NUMELS[p0]], DType::F32).unwrap();
    assert!(matches!(
        pipe.hand_bucket(0, &mut params, &wrong),
        Err(OffloadError::TensorMismatch {
            role: "gradient",
            ..
        })
    ));
    assert!(!pipe.step_in_progress());
    pipe.hand_bucket(0, &mut params, &grads).unwrap();
    assert!(matches!(
        pipe.hand_bucket(0, &mut params, &grads),
        Err(OffloadError::BucketHandedTwice { bucket: 0 })
    ));
    assert!(matches!(
        pipe.set_lr(0, 1e-4),
        Err(OffloadError::Pipeline(_))
    ));
    match pipe.finish(&mut params) {
        Err(OffloadError::BucketsMissing { missing }) => {
            assert_eq!(missing, (1..plan.num_buckets()).collect::<Vec<_>>())
        }
        other => panic!("{other:?}"),
    }
    // Nothing was lost: the rest can be handed over and the step finished.
    for b in 1..plan.num_buckets() {
        pipe.hand_bucket(b, &mut params, &grads).unwrap();
    }
    pipe.finish(&mut params).unwrap();
    let (opt, _) = pipe.shutdown().unwrap();
    assert_eq!(opt.state().steps, vec![1; NUMELS.len()]);
}
